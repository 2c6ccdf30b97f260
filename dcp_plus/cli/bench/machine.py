"""Machine state for benchmarks: load average, CPU used by other processes, the page cache,
the file system under a path, and a description of the machine.

Shared by ``benchmarks/save_load.py`` and ``dcp-plus bench``; the machine is shared, so every
figure is recorded next to what else was running.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import subprocess
import threading
import time
from typing import Any

import torch

from dcp_plus.shm import SHM_DIR
from dcp_plus.storage.direct import huge_pages


def load1() -> float:
    return os.getloadavg()[0]


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    v = [int(x) for x in parts]
    # user nice system idle iowait irq softirq ...: time charged to processes only
    return v[0] + v[1] + v[2]


def _kthread_ticks() -> int:
    """CPU of kernel threads (writeback, journal, reclaim): work the disk I/O causes."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rindex(")") + 2:].split()
        if name == "2" or fields[1] == "2":  # kthreadd and its children
            total += int(fields[11]) + int(fields[12])
    return total


def _proc_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return 0
    fields = s[s.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _children() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def _own_ticks() -> int:
    hz = os.sysconf("SC_CLK_TCK")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = round((ru.ru_utime + ru.ru_stime) * hz)
    return _proc_ticks(os.getpid()) + sum(_proc_ticks(p) for p in _children()) + reaped


class ForeignCpu:
    """CPU cores used over an interval by user processes other than this one and its children
    (kernel threads excluded: writeback and journalling work for whoever writes)."""

    def __enter__(self) -> ForeignCpu:
        self.t0 = time.perf_counter()
        self.busy0 = _busy_ticks()
        self.own0 = _own_ticks() + _kthread_ticks()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc: Any) -> None:
        dt = time.perf_counter() - self.t0
        hz = os.sysconf("SC_CLK_TCK")
        foreign = (_busy_ticks() - self.busy0) - (_own_ticks() + _kthread_ticks() - self.own0)
        self.cores = max(0.0, foreign / hz / dt) if dt > 0 else None


def drop_caches(paths: list[str]) -> str:
    """Empty the page cache (as root), else fadvise DONTNEED on every file under ``paths``."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        evict_files(list(paths))
        return "fadvise"


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, typ = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            real = os.path.realpath(path)
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best):
                best, kind = mnt, f"{typ} ({dev} on {mnt})"
    return kind


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    return {"commit": commit or "?", "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "shm_dir": SHM_DIR, "shm_huge": huge_pages(SHM_DIR)}  # None: 4 KiB pages


def files_under(paths: list[str]) -> list[str]:
    """The files at ``paths`` and under those of them that are directories, sorted."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += [os.path.join(dp, n) for dp, _, names in os.walk(p) for n in names]
        elif os.path.exists(p):
            out.append(p)
    return sorted(out)


def evict_files(paths: list[str]) -> None:
    """Drop only these files (or every file under these directories) from the page cache.

    ``fsync`` then ``POSIX_FADV_DONTNEED`` per file: unlike :func:`drop_caches` it neither
    syncs nor evicts what other processes on the machine are using.
    """
    for f in files_under(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                stack += kids
        except OSError:
            continue
    return out


def tree_pss() -> int:
    """Proportional set size (bytes) of this process and all its descendants: shared memory
    mapped by several of them (slabs, shm staging buffers) is counted once in total."""
    total = 0
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


class PeakMemory:
    """Peak of :func:`tree_pss` above its value at ``__enter__``, sampled every ``period`` s
    on a background thread (``extra`` bytes after ``__exit__``)."""

    def __init__(self, period: float = 0.02) -> None:
        self.period = period
        self.extra = 0
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-peak-memory",
                                        daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_pss())
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> PeakMemory:
        self.base = self.peak = tree_pss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_pss())
        self.extra = max(0, self.peak - self.base)
