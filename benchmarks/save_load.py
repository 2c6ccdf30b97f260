"""Durable save and cold load of a GPT-2-like + AdamW state dict: dcp_plus vs stock DCP vs disk.

    python -m benchmarks.save_load [--size-gib 2] [--repeats 3] [--dir PATH] [--json FILE]

Each repeat runs every case once, in a random order per repeat. Before each case: a 2 s
window in which other processes use < --max-foreign cores, ``sync`` + drop the page cache,
then --settle seconds (default 15; see below). Each save goes into a fresh directory, each
load reads from a cold page cache.

save  dd            buffered: ``dd if=/dev/zero of=F bs=64M conv=fsync`` of the state's bytes
      pwrite        buffered: the state's real bytes (from memory) in one pwrite stream +
                    fsync, and in 2 streams (2 files)
      O_DIRECT      the write limit: the same bytes with the page cache bypassed, by 1, 2 and
                    4 streams (threads, each writing its own file: a disjoint 4 KiB-aligned
                    slice, from the page-aligned slab: 4 KiB pages) + fsync of each file; and
                    the same from huge-page buffers: each stream writes every 64 MiB request
                    from its own reusable transparent-huge-page ring (``ring_buffers``; the
                    content does not matter to the device, and 8 GiB runs need no second
                    8 GiB). The best of the six is the O_DIRECT write limit
                    (``dcp_plus.cli.bench.limits``): a virtio-blk request takes at most 254
                    memory segments, so from 4 KiB pages requests top out near 1 MiB, from
                    2 MiB pages at the device's 4 MiB
      dcp_plus      ``dcp.save(sd, storage_writer=LocalWriter(d), no_dist=True)`` (threads=2,
                    and threads=4), in-process threads writing from tensor memory through
                    the process's aligned bounce buffers, kept from the save before (an
                    untimed save first where there was none: a process that saved will save
                    again); and the process's first save (``first``: the bounce pool
                    released just before, its 320 MiB mapped afresh as the save fills it)
      dcp_plus slab the same state copied once into a registered ``dcp_plus.memory.slabs.Slab``
                    (4 KiB-aligned views): the worker-process path (workers=2); the copy
                    into the slab is timed separately (``stage copy``). Two cases: workers
                    that have written this slab before (an untimed save first where they
                    have not: a training job's stager reuses its slabs), and workers new to
                    it (the pool restarted just before: they map the slab as they write)
      prototype     not dcp_plus: LocalWriter's thread path redone with O_DIRECT through
                    reusable bounce buffers (what the writer could do)
      stock         ``FileSystemWriter(d)`` defaults (single_file_per_rank=True,
                    sync_files=True, thread_count=1), and thread_count=2 / 4
load  dd            buffered: ``dd if=F of=/dev/null bs=64M`` over the dcp_plus data files,
                    one after another (and all at once: ``dd parallel``)
      O_DIRECT      the read limit: the 4 files of the O_DIRECT 4-stream save (not in the
                    page cache: written with O_DIRECT) read with O_DIRECT by 1, 2 and 4
                    streams (disjoint 4 KiB-aligned 64 MiB requests) into a page-aligned,
                    pre-faulted buffer (4 KiB pages), and by 1, 2 and 4 streams each reading
                    every request into its own huge-page ring; the best of the six is the
                    O_DIRECT read limit. And the dcp_plus files read into the state's own
                    tensors (their 4 KiB-aligned interiors; ``benchmarks.state_memory``), best
                    of 1/2/4 streams: what the device gives into the pages a load fills; not a
                    limit of the six (it overwrites the state, so the dcp_plus load, which puts
                    it back, always comes right after it)
      dcp_plus      ``dcp.load(sd, storage_reader=LocalReader(d), planner=SafeLoadPlanner(),
                    no_dist=True)``, verify on (threads 4 and 2) and off
      stock         ``FileSystemReader(d)`` with the default load planner
torch_checkpointing  meta-pytorch's ``CheckpointManager`` with ``use_direct_io=False`` and
                    ``=True`` (its default), saves and loads, in a phase of their own at the
                    end of each repeat (``benchmarks.save_load_tc``); not durable (no fsync)

Where the file system refuses O_DIRECT (ramfs, tmpfs before Linux 6.6, some FUSE and network
file systems), the O_DIRECT rows (and the prototype) say so ("n/a: O_DIRECT refused by ...")
and the x direct column is left empty.

Page cache: after every save, the share of the checkpoint's bytes resident in the page cache
(``mincore``; ``dcp_plus.cli.bench.pagecache``), and after every load that of the files it
read ("cache %": the goal is < 5 % after a save).

Why the settle: on this VM (virtio-balloon free page reporting) memory freed by dropping the
cache goes back to the host within seconds, and each page-cache page allocated after that
costs a host fault: buffered writes/reads then run at ~0.4-0.6 GB/s per stream whatever the
disk does (O_DIRECT: ~4 GB/s). Without the wait, a case's speed depends on which case ran
just before it (--settle 0 shows it).

Memory: the state, one slab of its size, and nothing else of that size: loads go into the
state's own tensors (zeroed first, then checked bit-exact against the xxh3-64 of every tensor
taken before the first save), the O_DIRECT read limit reads into the slab, and the slab is
released, and the writer workers that map it stopped, while torch_checkpointing (which
stages into shared memory of its own) runs: an 8 GiB run fits in 24 GiB. The workers are
started again after it; the slab case proper runs with workers that have written the slab
before (an untimed save first), the "workers new to it" case with a pool restarted just
before it.
Every case records the 1-minute load average before it and the CPU time other processes
used while it ran ("foreign CPU", in cores): the machine is shared.
Figures are medians over repeats. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from tqdm import tqdm

from benchmarks import save_load_tc as tc
from benchmarks.state_memory import state_scatter
from dcp_plus.cli.bench.limits import (
    STREAMS,
    aligned_buffer,
    dd_read,
    direct_read,
    direct_refusal,
    pwrite_files,
    read_span,
    ring_buffers,
)
from dcp_plus.cli.bench.machine import (
    ForeignCpu,
    drop_caches,
    fs_type,
    load1,
    machine,
)
from dcp_plus.cli.bench.models import (
    gpt2_like_state_dict,
    iter_tensors,
    map_tensors,
    shape_for_size,
    state_dict_nbytes,
)
from dcp_plus.cli.bench.pagecache import cached_now, residency
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.layout import align_up
from dcp_plus.format.values import byte_view
from dcp_plus.memory.slabs import Slab, registry
from dcp_plus.planners import SafeLoadPlanner
from dcp_plus.readers.local import LocalReader
from dcp_plus.shm import SHM_DIR
from dcp_plus.storage.direct import bounce_pool
from dcp_plus.storage.fileio import fsync_dir
from dcp_plus.writers.local import LocalWriter
from dcp_plus.writers.pool import shared_pool, shutdown_pool

CHUNK = 64 << 20
BOUNCE = 32 << 20
GB = 1e9

# Names of the cases (also the JSON keys).
W_DD = "save: buffered dd zeros conv=fsync"
W_PWRITE = "save: buffered pwrite 1 stream + fsync"
W_PWRITE2 = "save: buffered pwrite 2 streams + fsync"
W_DIRECT = {k: f"save: O_DIRECT pwrite {k} stream{'s' if k > 1 else ''} + fsync" for k in STREAMS}
W_HUGE = {k: f"save: O_DIRECT pwrite {k} stream{'s' if k > 1 else ''} + fsync, from huge-page "
             "buffers" for k in STREAMS}
W_PROTO = "save: prototype O_DIRECT via bounce buffers (threads=2)"
W_PLUS = "save: dcp_plus LocalWriter (threads=2)"
W_PLUS4 = "save: dcp_plus LocalWriter (threads=4)"
W_PLUS_FIRST = "save: dcp_plus LocalWriter (threads=2), first (bounce buffers mapped afresh)"
W_SLAB = "save: dcp_plus LocalWriter, slab (workers=2)"
W_SLAB_NEW = "save: dcp_plus LocalWriter, slab, workers new to it (workers=2)"
W_STOCK = "save: stock FileSystemWriter (thread_count=1)"
W_STOCK2 = "save: stock FileSystemWriter (thread_count=2)"
W_STOCK4 = "save: stock FileSystemWriter (thread_count=4)"
STAGE_FIRST = "stage copy into fresh slab"
STAGE = "stage copy into reused slab"
R_DD = "load: buffered dd cold read, sequential"
R_DDPAR = "load: buffered dd cold read, parallel"
R_DIRECT = {k: f"load: O_DIRECT cold read, {k} stream{'s' if k > 1 else ''}" for k in STREAMS}
R_HUGE = {k: f"load: O_DIRECT cold read, {k} stream{'s' if k > 1 else ''}, into huge-page "
             "buffers" for k in STREAMS}
R_PLUS = "load: dcp_plus LocalReader (verify, threads=4)"
R_PLUS2 = "load: dcp_plus LocalReader (verify, threads=2)"
R_NOVERIFY = "load: dcp_plus LocalReader (no verify, threads=4)"
R_SLAB = "load: dcp_plus LocalReader (verify), slab-written ckpt"
R_STOCK = "load: stock FileSystemReader"
R_STATE = ("load: O_DIRECT cold read into the state's own memory, best of "
           f"{'/'.join(map(str, STREAMS))} streams")
ORDER = [W_DD, W_PWRITE, W_PWRITE2, *W_DIRECT.values(), *W_HUGE.values(), W_PLUS, W_PLUS_FIRST,
         W_PLUS4, W_PROTO, STAGE_FIRST, STAGE, W_SLAB, W_SLAB_NEW, W_STOCK, W_STOCK2, W_STOCK4,
         *tc.SAVES, R_DD, R_DDPAR, *R_DIRECT.values(), *R_HUGE.values(), R_STATE, R_PLUS, R_PLUS2,
         R_NOVERIFY, R_SLAB, R_STOCK, *tc.LOADS]


# ----------------------------------------------------------------------------- timing helpers

@dataclass
class Sample:
    seconds: float
    load1: float
    foreign_cores: float | None
    parts: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    cache: float | None = None  # share of the case's files in the page cache afterwards


def timed_methods(obj: Any, names: list[str], parts: dict[str, float]) -> Any:
    """Wrap ``obj``'s methods so that their wall time adds up in ``parts``."""
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*a: Any, __fn: Callable[..., Any] = fn, __name: str = name,
                    **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                parts[__name] = parts.get(__name, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)
    return obj


def dir_bytes(path: str) -> tuple[int, int]:
    n = size = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            n += 1
            size += os.path.getsize(os.path.join(dirpath, name))
    return n, size


def data_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if not f.startswith("."))


# ----------------------------------------------------------------------------- slab staging

class SlabState:
    """The state dict copied into one registered slab, tensors 4 KiB-aligned in order."""

    def __init__(self, sd: dict[str, Any]) -> None:
        tensors = list(iter_tensors(sd))
        self.offsets: dict[str, int] = {}
        off = 0
        for name, t in tensors:
            self.offsets[name] = off
            off = align_up(off + t.numel() * t.element_size())
        self.slab = Slab(max(off, 1))
        registry.register(self.slab)
        flat = self.slab.tensor()
        views: dict[int, torch.Tensor] = {}
        for name, t in tensors:
            o = self.offsets[name]
            n = t.numel() * t.element_size()
            views[id(t)] = flat[o:o + n].view(t.dtype).view(t.shape)
        del flat
        self.state = map_tensors(sd, lambda t: views[id(t)])
        self._pairs = [(views[id(t)], t) for _, t in tensors]

    def copy_in(self) -> None:
        for dst, src in self._pairs:
            dst.copy_(src)

    def close(self) -> None:
        self.state = None
        self._pairs = []
        registry.unregister(self.slab)
        gc.collect()
        try:
            self.slab.close()
        except BufferError:  # a view is still alive somewhere: unlink the name anyway
            os.unlink(os.path.join(SHM_DIR, self.slab.name))
            log(f"warning: slab {self.slab.name} still had views; unlinked it")


# ----------------------------------------------------------------------------- the cases

class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        self.drop_method = "?"
        self.bounce: list[mmap.mmap] = []
        self.bounce_warm = False  # the writer's bounce pool filled by a save before
        self.bar: tqdm | None = None
        self.read_buf: mmap.mmap | None = None
        self.refused: str | None = None  # why the file system refuses O_DIRECT
        self.cache_method = "?"
        self.na: dict[str, str] = {}  # rows that could not run, and why

    # -- saves
    def save_dd(self, d: str) -> Sample:
        f = os.path.join(d, "dd.bin")
        cmd = ["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={self.nbytes}",
               "iflag=count_bytes", "conv=fsync", "status=none"]
        return self._measure(lambda: subprocess.run(cmd, check=True), leaves=[d])

    def save_pwrite(self, d: str, streams: int = 1, direct: bool = False,
                    huge: bool = False) -> Sample:
        """The state's bytes (from the warm, page-aligned slab) in ``streams`` files + fsync
        (``direct``: O_DIRECT, see :func:`dcp_plus.cli.bench.limits.pwrite_files`; ``huge``:
        as many bytes, O_DIRECT from each stream's huge-page ring)."""
        if huge:
            rings = ring_buffers(streams)
            return self._measure(lambda: pwrite_files(None, self.nbytes, d, streams, True,
                                                      rings), leaves=[d])
        buf = self.slab.slab.buffer
        try:
            return self._measure(lambda: pwrite_files(buf, self.nbytes, d, streams, direct),
                                 leaves=[d])
        finally:
            buf.release()

    def save_proto_direct(self, d: str, threads: int = 2) -> Sample:
        """What LocalWriter's thread path could do: O_DIRECT through reusable bounce buffers.

        Not dcp_plus code. Same work as ``LocalWriter._write_in_process`` (size-balanced files,
        4 KiB-aligned extents, an xxh3 checksum per tensor, fsync per file and of the
        directory), but each thread copies tensor bytes into its own pre-faulted, page-aligned
        buffer (tensor memory is not 4 KiB-aligned) and writes it with O_DIRECT, so no page
        cache pages are allocated, filled and written back.
        """
        views = [byte_view(t.contiguous()) for _, t in iter_tensors(self.sd)]
        groups: list[list[memoryview]] = [[] for _ in range(threads)]
        sizes = [0] * threads
        for v in sorted(views, key=len, reverse=True):
            i = sizes.index(min(sizes))
            groups[i].append(v)
            sizes[i] += align_up(len(v))
        while len(self.bounce) < threads:
            m = mmap.mmap(-1, BOUNCE)
            m.write(bytes(BOUNCE))  # pre-fault once; reused by every later save
            self.bounce.append(m)

        def one(i: int) -> None:
            buf = memoryview(self.bounce[i])
            path = os.path.join(d, f"proto{i}.bin")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            base = fill = off = 0

            def flush(n: int) -> None:
                nonlocal base, fill
                n = align_up(n)
                done = 0
                while done < n:
                    done += os.pwrite(fd, buf[done:n], base + done)
                base += n
                fill = 0

            try:
                for v in groups[i]:
                    checksum_bytes(v)
                    pos = 0
                    while pos < len(v):
                        at = off + pos - base
                        if at >= BOUNCE:
                            flush(BOUNCE)
                            continue
                        n = min(len(v) - pos, BOUNCE - at)
                        buf[at:at + n] = v[pos:pos + n]
                        pos += n
                        fill = at + n
                    end, nxt = off + len(v), align_up(off + len(v))
                    if nxt - base <= BOUNCE:
                        buf[end - base:nxt - base] = bytes(nxt - end)
                        fill = nxt - base
                    off = nxt
                if fill:
                    flush(fill)
                os.fsync(fd)
            finally:
                os.close(fd)
                buf.release()

        def run() -> None:
            with ThreadPoolExecutor(threads) as ex:
                for f in [ex.submit(one, i) for i in range(threads)]:
                    f.result()
            fsync_dir(d)
        return self._measure(run, leaves=[d])

    def save_dcp(self, d: str, writer: Any, state: dict[str, Any]) -> Sample:
        parts: dict[str, float] = {}
        timed_methods(writer, ["write_data", "finish"], parts)

        def run() -> None:
            dcp.save(state, storage_writer=writer, no_dist=True)
        s = self._measure(run, leaves=[d])
        s.parts = {"plan+other": s.seconds - sum(parts.values()), **parts}
        s.extra["files"], s.extra["bytes"] = dir_bytes(d)
        return s

    # -- loads
    def load_dd(self, files: list[str], parallel: bool) -> Sample:
        return self._measure(lambda: dd_read(files, parallel), cold=files)

    def load_direct(self, files: list[str], streams: int, huge: bool = False) -> Sample:
        """Read ``files`` with O_DIRECT (page cache bypassed) by ``streams`` threads into one
        warm, page-aligned buffer: what the device delivers to memory that is already faulted
        in (like a live model's tensors); ``huge``: each stream into its own huge-page ring
        (what the device delivers at best)."""
        if huge:
            rings = ring_buffers(streams)
            return self._measure(lambda: direct_read(files, streams, None, rings), cold=files)
        need = read_span(files)
        buf = self.slab.slab.buffer  # scratch until the next save copies into it
        if len(buf) < need:
            buf.release()
            if self.read_buf is None or len(self.read_buf) < need:
                self.read_buf = aligned_buffer(need)  # faulted in once, reused
            buf = memoryview(self.read_buf)
        try:
            return self._measure(lambda: direct_read(files, streams, buf), cold=files)
        finally:
            buf.release()

    def load_direct_state(self, files: list[str]) -> Sample:
        """The best of 1/2/4 streams reading ``files`` with O_DIRECT into the state's own
        tensors (their 4 KiB-aligned interiors, a scratch buffer for the rest): what the
        device gives into the pages a load fills. It overwrites the state: the dcp_plus load
        runs right after it and puts the state back."""
        into = state_scatter([t for _, t in iter_tensors(self.sd)], read_span(files))
        def one(k: int) -> Sample:
            return self._measure(lambda: direct_read(files, k, into), cold=files)
        return min((one(k) for k in STREAMS), key=lambda s: s.seconds)

    def load_dcp(self, d: str, reader: Any, planner: Any) -> Sample:
        parts: dict[str, float] = {}
        timed_methods(reader, ["read_metadata", "set_up_storage_reader", "read_data"], parts)
        s = self.load_into_state(
            lambda: dcp.load(self.sd, storage_reader=reader, planner=planner, no_dist=True), d)
        s.parts = {"plan+other": s.seconds - sum(parts.values()), **parts}
        return s

    def state_sums(self) -> list[str]:
        return [checksum_bytes(byte_view(t)) for _, t in iter_tensors(self.sd)]

    def load_into_state(self, run: Callable[[], Any], d: str) -> Sample:
        """Zero the state's tensors, time ``run`` (a load of ``d`` into them) from a cold
        cache, then check every tensor against its checksum taken before the first save."""
        for _, t in iter_tensors(self.sd):
            t.zero_()
        s = self._measure(run, cold=[d])
        t0 = time.perf_counter()
        ok = self.state_sums() == self.sums and (
            self.sd["optim"]["param_groups"] == self.param_groups)
        s.extra["verify_s"] = time.perf_counter() - t0
        if not ok:
            raise AssertionError(f"loaded state differs from the saved one ({d})")
        return s

    def _measure(self, fn: Callable[[], Any], cold: list[str] | None = None,
                 leaves: list[str] | None = None) -> Sample:
        """Time ``fn`` from a cold page cache; then the share of the files at ``leaves`` (a
        save's directory; a load's ``cold`` files by default) left in the page cache."""
        waited = self.quiet_window()
        self.drop_method = drop_caches(cold or [])
        with ForeignCpu() as idle:
            time.sleep(self.args.settle)
        l1 = load1()
        base = cached_now()
        with ForeignCpu() as fc:
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
        cache = residency(leaves or cold or [], base)
        self.cache_method = cache.method
        return Sample(dt, l1, fc.cores, extra={"foreign_cores_settle": idle.cores,
                                               "waited_for_quiet_s": round(waited, 1)},
                      cache=cache.fraction if cache.total else None)

    def quiet_window(self) -> float:
        """Wait (at most ``--wait-s``) for 2 s in which other processes use under
        ``--max-foreign`` cores; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.args.wait_s:
            with ForeignCpu() as fc:
                time.sleep(2)
            if fc.cores is None or fc.cores < self.args.max_foreign:
                break
            if self.bar is not None:
                self.bar.set_postfix_str(f"waiting: other processes use {fc.cores:.2f} cores")
        return time.monotonic() - t0

    # -- driver
    def wait_quiet(self, bar: tqdm) -> float:
        """Wait (at most ``--wait-s``) until the machine is quiet; returns the load average.

        Quiet: 1-min load average below ``--max-load``, or other processes used under
        ``--max-foreign`` cores over the last 5 s (this benchmark's own fsync-blocked threads
        keep the load average up for a minute after each case).
        """
        deadline = time.monotonic() + self.args.wait_s
        while time.monotonic() < deadline and load1() >= self.args.max_load:
            with ForeignCpu() as fc:
                time.sleep(5)
            if fc.cores is not None and fc.cores < self.args.max_foreign:
                break
            bar.set_postfix_str(f"waiting: load avg {load1():.2f}, other processes "
                                f"{fc.cores:.2f} cores")
        return load1()

    def run(self) -> dict[str, Any]:
        a = self.args
        self.machine = machine()  # the commit measured is the one imported now
        shape = shape_for_size(a.size_gib * 2**30)
        log(f"building state dict: {shape} ({shape.num_tensors} tensors, "
            f"{shape.nbytes / 2**30:.2f} GiB)")
        t = time.perf_counter()
        self.sd = gpt2_like_state_dict(shape)
        self.nbytes = state_dict_nbytes(self.sd)
        log(f"  built in {time.perf_counter() - t:.1f}s; checksums (loads are checked "
            "against them) ...")
        self.sums = self.state_sums()
        self.param_groups = copy.deepcopy(self.sd["optim"]["param_groups"])
        self.tc_missing = tc.missing()
        if self.tc_missing:
            log(f"  no torch_checkpointing rows: {self.tc_missing}")
            self.na.update({n: f"n/a: {self.tc_missing}" for n in tc.SAVES + tc.LOADS})
        log("  staging into a shared-memory slab ...")
        t = time.perf_counter()
        self.slab = SlabState(self.sd)
        self.slab_mapped = False  # no worker has written this slab yet
        alloc = time.perf_counter() - t
        t = time.perf_counter()
        self.slab.copy_in()
        self.samples[STAGE_FIRST].append(Sample(time.perf_counter() - t, load1(), None,
                                                extra={"alloc_s": alloc}))

        os.makedirs(a.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="dcpp-bench-", dir=a.dir)
        log(f"  checkpoints under {root} [{fs_type(root)}]")
        if fs_type(root).startswith("tmpfs"):
            log("  WARNING: tmpfs is not a disk: the figures will not mean what they say")
        self.refused = direct_refusal(root)
        if self.refused:
            log(f"  {self.refused}: no O_DIRECT limits, no prototype")

        saves: list[tuple[str, Callable[[str], Sample]]] = [
            (W_DD, self.save_dd),
            (W_PWRITE, self.save_pwrite),
            (W_PWRITE2, lambda d: self.save_pwrite(d, streams=2)),
            (W_PLUS, lambda d: self._save_plus(d, threads=2)),
            (W_PLUS_FIRST, self._save_plus_first),
            (W_SLAB, self._save_slab),
            (W_SLAB_NEW, self._save_slab_new),
            (W_STOCK, lambda d: self.save_dcp(d, FileSystemWriter(d), self.sd)),
        ]
        if not self.refused:
            saves += [(W_DIRECT[k], lambda d, k=k: self.save_pwrite(d, streams=k, direct=True))
                      for k in STREAMS]
            saves += [(W_HUGE[k], lambda d, k=k: self.save_pwrite(d, k, True, huge=True))
                      for k in STREAMS]
            saves.append((W_PROTO, self.save_proto_direct))
        if not a.no_variants:
            saves += [
                (W_PLUS4, lambda d: self._save_plus(d, threads=4)),
                (W_STOCK2, lambda d: self.save_dcp(d, FileSystemWriter(d, thread_count=2),
                                                   self.sd)),
                (W_STOCK4, lambda d: self.save_dcp(d, FileSystemWriter(d, thread_count=4),
                                                   self.sd)),
            ]
        keep = {W_PLUS, W_SLAB, W_STOCK, W_DIRECT[max(STREAMS)]}
        n_loads = 5 + (0 if self.refused else 2 * len(STREAMS) + 1) + (0 if a.no_variants else 2)
        n_tc = 0 if self.tc_missing else len(tc.SAVES) + len(tc.LOADS)
        bar = tqdm(total=a.repeats * (len(saves) + n_loads + n_tc), file=sys.stderr, unit="case",
                   dynamic_ncols=True)
        self.bar = bar
        self.load_at_start: list[float] = []
        try:
            for rep in range(a.repeats):
                self.load_at_start.append(self.wait_quiet(bar))
                kept: dict[str, str] = {}
                # a fresh random order per repeat: no case always follows the same one
                order = random.Random(rep).sample(saves, len(saves))
                for name, fn in order:
                    bar.set_postfix_str(f"rep {rep + 1}: {name}")
                    d = os.path.join(root, f"r{rep}-{len(kept)}-{abs(hash(name)) % 10**6}")
                    os.makedirs(d)
                    self.samples[name].append(fn(d))
                    if name in keep:
                        kept[name] = d
                    else:
                        shutil.rmtree(d)
                    bar.update()
                loads = self._loads(kept)
                order_l = after_state_read(random.Random(1000 + rep).sample(loads, len(loads)))
                for name, fn_l in order_l:
                    bar.set_postfix_str(f"rep {rep + 1}: {name}")
                    self.samples[name].append(fn_l())
                    bar.update()
                for d in kept.values():
                    shutil.rmtree(d)
                if not self.tc_missing:
                    bar.set_postfix_str(f"rep {rep + 1}: torch_checkpointing")
                    # its staging memory instead of the slab (8 GiB runs); the workers map
                    # the slab until they stop
                    shutdown_pool()
                    self.slab.close()
                    gc.collect()
                    try:
                        bar.update(tc.run_phase(self, root, rep, log))
                    finally:
                        self.slab = SlabState(self.sd)
                        self.slab_mapped = False
                        self.slab.copy_in()
                        shared_pool(2)  # started again (the first save starts it too)
                    for name in os.listdir(root):
                        shutil.rmtree(os.path.join(root, name))
        finally:
            bar.close()
            shutil.rmtree(root, ignore_errors=True)
            shutdown_pool()
            self.slab.close()
        return self.report(shape)

    def _loads(self, kept: dict[str, str]) -> list[tuple[str, Callable[[], Sample]]]:
        plus, slab, stock = kept[W_PLUS], kept[W_SLAB], kept[W_STOCK]
        files = data_files(plus)
        loads: list[tuple[str, Callable[[], Sample]]] = [
            (R_DD, lambda: self.load_dd(files, parallel=False)),
            (R_DDPAR, lambda: self.load_dd(files, parallel=True)),
            (R_PLUS, lambda: self.load_dcp(plus, LocalReader(plus), SafeLoadPlanner())),
            (R_NOVERIFY, lambda: self.load_dcp(plus, LocalReader(plus, verify=False),
                                               SafeLoadPlanner())),
            (R_STOCK, lambda: self.load_dcp(stock, FileSystemReader(stock), None)),
        ]
        if not self.refused:  # the files of the widest O_DIRECT save: not in the page cache
            direct = data_files(kept[W_DIRECT[max(STREAMS)]])
            loads += [(R_DIRECT[k], lambda k=k: self.load_direct(direct, k)) for k in STREAMS]
            loads += [(R_HUGE[k], lambda k=k: self.load_direct(direct, k, huge=True))
                      for k in STREAMS]
            loads.append((R_STATE, lambda: self.load_direct_state(files)))
        if not self.args.no_variants:
            loads += [
                (R_PLUS2, lambda: self.load_dcp(plus, LocalReader(plus, threads=2),
                                                SafeLoadPlanner())),
                (R_SLAB, lambda: self.load_dcp(slab, LocalReader(slab), SafeLoadPlanner())),
            ]
        return loads

    def _save_plus(self, d: str, threads: int) -> Sample:
        """A save through bounce buffers the process mapped for a save before (an untimed
        save first where there was none)."""
        if not self.bounce_warm:
            untimed_save(self.sd, f"{d}.warm-up", lambda w: LocalWriter(w, threads=threads))
            self.bounce_warm = True
        return self.save_dcp(d, LocalWriter(d, threads=threads), self.sd)

    def _save_plus_first(self, d: str) -> Sample:
        """A process's first save: the bounce pool released, its buffers mapped as filled."""
        bounce_pool.release_idle()
        s = self.save_dcp(d, LocalWriter(d, threads=2), self.sd)
        self.bounce_warm = True  # the pool keeps what this save mapped
        return s

    def _save_slab(self, d: str) -> Sample:
        """A save by workers that wrote this slab before (as from a job's second checkpoint
        on: the stager reuses its slabs); an untimed save first where they have not."""
        if not self.slab_mapped:
            untimed_save(self.slab.state, f"{d}.warm-up", lambda w: LocalWriter(w, workers=2))
            self.slab_mapped = True
        return self._slab_save(d)

    def _save_slab_new(self, d: str) -> Sample:
        """A save by workers just started (the first checkpoint of a new slab: the workers
        map it, 4 KiB pages in /dev/shm, as they write)."""
        shutdown_pool()
        shared_pool(2)
        self.slab_mapped = False
        s = self._slab_save(d)
        self.slab_mapped = True
        return s

    def _slab_save(self, d: str) -> Sample:
        t = time.perf_counter()
        self.slab.copy_in()  # steady state: the scratch is reused, pages already faulted
        self.samples[STAGE].append(Sample(time.perf_counter() - t, load1(), None))
        return self.save_dcp(d, LocalWriter(d, workers=2), self.slab.state)

    # -- report
    def report(self, shape: Any) -> dict[str, Any]:
        def med(name: str) -> float:
            return statistics.median(s.seconds for s in self.samples[name])

        limits = {
            # the definitions: one buffered stream + fsync / one cold sequential read
            "write": min((W_DD, W_PWRITE), key=med),
            "read": R_DD,
            # the fastest buffered (page cache) baseline, parallel streams included
            "write_best": min((W_DD, W_PWRITE, W_PWRITE2), key=med),
            "read_best": min((R_DD, R_DDPAR), key=med),
        }
        if not self.refused:
            # the page cache bypassed, the best of 1/2/4 streams from/into 4 KiB pages and
            # huge pages: what the device takes/gives
            limits["write_direct"] = min([*W_DIRECT.values(), *W_HUGE.values()], key=med)
            limits["read_direct"] = min([*R_DIRECT.values(), *R_HUGE.values()], key=med)
            # the best from/into 4 KiB pages only (the limit before huge-page rows)
            limits["write_direct_4k"] = min(W_DIRECT.values(), key=med)
            limits["read_direct_4k"] = min(R_DIRECT.values(), key=med)

        def rel(a: str, b: str) -> float | None:
            return med(a) / med(b) if self.samples[a] and self.samples[b] else None

        def x(name: str, limit: str) -> float | None:
            return rel(name, limits[limit]) if limit in limits else None

        def paired(name: str, limit: str) -> float | None:
            """Median over repeats of this case / the limit measured in the same repeat."""
            return paired_rel(name, limits[limit])

        def paired_rel(name: str, other: str) -> float | None:
            """Median over repeats of case ``name`` / case ``other`` in the same repeat."""
            a, b = self.samples[name], self.samples[other]
            if not a or not b:
                return None
            return statistics.median(s.seconds / t.seconds for s, t in zip(a, b, strict=False))

        rows: dict[str, dict[str, Any]] = {}
        for name in sorted(self.samples, key=ORDER.index):
            ss = self.samples[name]
            m = med(name)
            row: dict[str, Any] = {
                "median_s": m, "min_s": min(s.seconds for s in ss),
                "max_s": max(s.seconds for s in ss), "GB_per_s": self.nbytes / GB / m,
                "load1": [round(s.load1, 2) for s in ss],
                "foreign_cores": [None if s.foreign_cores is None else round(s.foreign_cores, 2)
                                  for s in ss],
                "runs_s": [round(s.seconds, 3) for s in ss],
            }
            caches = [s.cache for s in ss if s.cache is not None]
            if caches:
                row["page_cache_pct"] = 100 * statistics.median(caches)
            if ss[0].parts:
                row["parts_median_s"] = {k: statistics.median(s.parts.get(k, 0.0) for s in ss)
                                         for k in ss[0].parts}
            if ss[0].extra:
                row["extra"] = [s.extra for s in ss]
            kind = "write" if name.startswith("save") else "read" if name.startswith(
                "load") else None
            if kind:
                row["x_limit"] = x(name, kind)
                row["x_best"] = x(name, kind + "_best")
                if self.refused is None:
                    row["x_direct"] = x(name, kind + "_direct")
            rows[name] = row
        if self.refused:
            for name in [*W_DIRECT.values(), *W_HUGE.values(), W_PROTO, *R_DIRECT.values(),
                         *R_HUGE.values()]:
                rows[name] = {"na": f"n/a: {self.refused}"}
        for name, why in self.na.items():
            rows.setdefault(name, {"na": why})
        rows = {n: rows[n] for n in sorted(rows, key=ORDER.index)}
        ratios = {
            "save dcp_plus / write limit": x(W_PLUS, "write"),
            "save dcp_plus / write limit, paired": paired(W_PLUS, "write"),
            "save dcp_plus / best buffered write": x(W_PLUS, "write_best"),
            "save dcp_plus / O_DIRECT write limit": x(W_PLUS, "write_direct"),
            "save dcp_plus, first / O_DIRECT write limit": x(W_PLUS_FIRST, "write_direct"),
            "save dcp_plus slab / write limit": x(W_SLAB, "write"),
            "save stock / write limit": x(W_STOCK, "write"),
            "save dcp_plus slab / O_DIRECT write limit": x(W_SLAB, "write_direct"),
            "save dcp_plus slab / O_DIRECT write limit, 4 KiB pages": x(W_SLAB,
                                                                         "write_direct_4k"),
            "save dcp_plus slab, new workers / O_DIRECT write limit": x(W_SLAB_NEW,
                                                                         "write_direct"),
            "save stock / dcp_plus": rel(W_STOCK, W_PLUS),
            "save slab path / threads path": rel(W_SLAB, W_PLUS),
            "save O_DIRECT prototype / write limit": x(W_PROTO, "write"),
            "save O_DIRECT prototype / threads path": rel(W_PROTO, W_PLUS),
            "save (copy + slab path) / threads path": (med(STAGE) + med(W_SLAB)) / med(W_PLUS),
            "load dcp_plus / read limit": x(R_PLUS, "read"),
            "load dcp_plus / read limit, paired": paired(R_PLUS, "read"),
            "load dcp_plus / best buffered read": x(R_PLUS, "read_best"),
            "load dcp_plus / O_DIRECT read limit": x(R_PLUS, "read_direct"),
            "load dcp_plus / O_DIRECT read limit, 4 KiB pages": x(R_PLUS, "read_direct_4k"),
            "load dcp_plus / O_DIRECT read into the state's memory": rel(R_PLUS, R_STATE),
            "load dcp_plus / O_DIRECT read into the state's memory, paired": paired_rel(
                R_PLUS, R_STATE),
            "load dcp_plus no-verify / O_DIRECT read limit": x(R_NOVERIFY, "read_direct"),
            "load dcp_plus no-verify / read limit": x(R_NOVERIFY, "read"),
            "load stock / read limit": x(R_STOCK, "read"),
            "load stock / dcp_plus": rel(R_STOCK, R_PLUS),
        }
        targets: dict[str, bool | None] = {
            "save <= 1.15 x write limit": ratios["save dcp_plus / write limit"] <= 1.15,
            "load <= 1.25 x read limit": ratios["load dcp_plus / read limit"] <= 1.25,
        }
        for key, ratio in (("save <= 1.15 x O_DIRECT write limit",
                            "save dcp_plus / O_DIRECT write limit"),
                           ("load <= 1.15 x O_DIRECT read limit",
                            "load dcp_plus / O_DIRECT read limit")):
            v = ratios[ratio]
            targets[key] = None if v is None else v <= 1.15
        left = rows[W_PLUS].get("page_cache_pct")
        targets["page cache after a dcp_plus save < 5 %"] = None if left is None else left < 5
        return {
            "command": " ".join(["python -m benchmarks.save_load"] + sys.argv[1:]),
            "machine": self.machine,
            "model": {"d_model": shape.d_model, "layers": shape.layers,
                      "params": shape.num_params, "tensors": shape.num_tensors,
                      "tensor_bytes": self.nbytes},
            "repeats": self.args.repeats,
            "cache_drop": self.drop_method,
            "settle_s": self.args.settle,
            "limits": limits,
            "direct_refused": self.refused,
            "page_cache_method": self.cache_method,
            "load1_at_repeat_start": [round(v, 2) for v in self.load_at_start],
            "cases": rows, "ratios": ratios, "targets": targets,
        }


def untimed_save(state: dict[str, Any], d: str, writer: Callable[[str], Any]) -> None:
    """Save ``state`` into ``d`` with ``writer(d)`` and remove it: a warm-up, not measured."""
    dcp.save(state, storage_writer=writer(d), no_dist=True)
    shutil.rmtree(d)


def after_state_read(order: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``order`` with the read into the state's memory (which overwrites it) moved to right
    before the dcp_plus load that puts the state back."""
    state = [c for c in order if c[0] == R_STATE]
    rest = [c for c in order if c[0] != R_STATE]
    at = next(i for i, c in enumerate(rest) if c[0] == R_PLUS)
    return rest[:at] + state + rest[at:]


def log(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


def print_table(res: dict[str, Any]) -> None:
    m = res["model"]
    print(f"state dict: GPT-2-like d_model={m['d_model']} layers={m['layers']}, "
          f"{m['params'] / 1e6:.0f}M params, {m['tensors']} tensors, "
          f"{m['tensor_bytes'] / GB:.3f} GB; medians of {res['repeats']} repeats; "
          f"cold cache via {res['cache_drop']}, then {res['settle_s']:g}s settle before each case")
    lim = res["limits"]
    direct = (f"x direct: vs the O_DIRECT limits, the best of {'/'.join(map(str, STREAMS))} "
              f"streams from/into 4 KiB and huge pages ({lim['write_direct']!r}, "
              f"{lim['read_direct']!r})"
              if "write_direct" in lim else f"x direct: n/a ({res['direct_refused']})")
    print(f"x limit: vs the issue's buffered limits ({lim['write']!r}, {lim['read']!r}); x best: "
          f"vs the fastest buffered baseline ({lim['write_best']!r}, {lim['read_best']!r}); "
          f"{direct}; cache %: the case's files in the page cache after it "
          f"({res['page_cache_method']})")
    w = max(len(k) for k in res["cases"])
    print(f"{'case':<{w}}  {'median s':>8} {'min':>6} {'max':>6} {'GB/s':>6} "
          f"{'x limit':>7} {'x best':>7} {'x direct':>8} {'cache %':>7}  {'load1':>15}  "
          f"{'foreign cores':>15}")
    for name, r in res["cases"].items():
        if "na" in r:
            print(f"{name:<{w}}  {r['na']}")
            continue
        xs = " ".join(f"{r[k]:{n}.2f}" if r.get(k) is not None else " " * n
                      for k, n in (("x_limit", 7), ("x_best", 7), ("x_direct", 8)))
        cache = f"{r['page_cache_pct']:7.1f}" if "page_cache_pct" in r else " " * 7
        l1 = ",".join(f"{v:.1f}" for v in r["load1"])
        fc = ",".join("-" if v is None else f"{v:.2f}" for v in r["foreign_cores"])
        print(f"{name:<{w}}  {r['median_s']:8.2f} {r['min_s']:6.2f} {r['max_s']:6.2f} "
              f"{r['GB_per_s']:6.2f} {xs} {cache}  {l1:>15}  {fc:>15}")
    print("\nbreakdown (median s):")
    for name, r in res["cases"].items():
        if "parts_median_s" in r:
            parts = "  ".join(f"{k} {v:.2f}" for k, v in r["parts_median_s"].items())
            print(f"  {name:<{w}}  {parts}")
    print("\nratios (of medians unless paired):")
    for k, v in res["ratios"].items():
        print(f"  {k:<56} {'   n/a' if v is None else f'{v:6.2f}'}")
    for k, v in res["targets"].items():
        print(f"  target {k:<49} {'n/a' if v is None else 'met' if v else 'MISSED'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0, help="state dict size (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians reported")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="directory on the disk under test (a temporary subdirectory is made "
                        "and removed); not /dev/shm")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--settle", type=float, default=15.0,
                   help="seconds to wait after sync + dropping caches before each case "
                        "(default 15: on VMs with free page reporting, freed memory goes back "
                        "to the host within seconds and page-cache pages then cost a host "
                        "fault each; waiting makes every case start in that same state)")
    p.add_argument("--no-variants", action="store_true",
                   help="skip the threads=4 / thread_count=2,4 / slab-load variants")
    p.add_argument("--max-load", type=float, default=1.5,
                   help="wait before each repeat until the 1-min load average is below this")
    p.add_argument("--max-foreign", type=float, default=0.2,
                   help="...or until other processes use fewer cores than this (over 5 s); "
                        "each case also waits for 2 s under this before it starts")
    p.add_argument("--wait-s", type=float, default=600, help="longest wait for quiet")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    res = Bench(args).run()
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
