"""Writer worker process: maps stager slabs, checksums extents, pwrites and fsyncs files.

Started as ``python -m dcp_plus._worker FD``. It imports neither torch nor the user's
``__main__`` (unlike multiprocessing's spawn), so it starts in tens of milliseconds and needs
no ``if __name__ == "__main__"`` guard in training scripts. It exits when its parent dies:
the socket reads EOF while idle, and ``getppid()`` is checked between write chunks.
"""

from __future__ import annotations

import mmap
import os
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.fileio import pwrite_all

SHM_DIR = "/dev/shm"
# Only alignment padding (< 4 KiB, zeros in a stager slab) is written between extents: a
# larger gap may hold a tensor this rank does not write, which `verify` would flag as damage.
COALESCE_GAP = 4095


@dataclass(frozen=True)
class WriteJob:
    """Write ``ranges`` of shared-memory slabs into ``path`` (which exists already).

    Each range is ``(slab name, slab offset, file offset, length)`` and is one extent: its
    checksum is returned in order.
    """

    path: str
    ranges: list[tuple[str, int, int, int]]
    fsync: bool = True


class ParentGone(Exception):
    pass


class _Mappings:
    """Slab mappings kept across jobs; dropped once the creator unlinks the slab."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}

    def get(self, name: str) -> mmap.mmap:
        if "/" in name:
            raise ValueError(f"bad slab name {name!r}")
        hit = self._maps.get(name)
        path = os.path.join(SHM_DIR, name)
        if hit is not None:
            try:
                if os.stat(path).st_ino == hit[1]:
                    return hit[0]
            except FileNotFoundError:
                pass
            self._drop(name)
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        self._maps[name] = (m, ino)
        return m

    def _drop(self, name: str) -> None:
        m, _ = self._maps.pop(name)
        m.close()

    def prune(self) -> None:
        for name in list(self._maps):
            if not os.path.exists(os.path.join(SHM_DIR, name)):
                self._drop(name)


def coalesce(ranges: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int, int]]:
    """Merge ranges adjacent in both slab and file (equal small gaps included)."""
    out: list[tuple[str, int, int, int]] = []
    for slab, soff, foff, n in sorted(ranges, key=lambda r: r[2]):
        if out:
            pslab, psoff, pfoff, pn = out[-1]
            gap = foff - (pfoff + pn)
            if pslab == slab and 0 <= gap <= COALESCE_GAP and soff - (psoff + pn) == gap:
                out[-1] = (pslab, psoff, pfoff, pn + gap + n)
                continue
        out.append((slab, soff, foff, n))
    return out


def run_job(job: WriteJob, maps: _Mappings, parent: int) -> list[str]:
    def check_parent() -> None:
        if os.getppid() != parent:
            raise ParentGone

    sums = []
    for slab, soff, _foff, n in job.ranges:
        sums.append(checksum_bytes(memoryview(maps.get(slab))[soff : soff + n]))
    fd = os.open(job.path, os.O_WRONLY)
    try:
        for slab, soff, foff, n in coalesce(job.ranges):
            pwrite_all(fd, memoryview(maps.get(slab))[soff : soff + n], foff, check_parent)
        if job.fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return sums


def main(fd: int) -> None:
    parent = os.getppid()
    conn = Connection(fd)
    maps = _Mappings()
    while True:
        while not conn.poll(0.5):
            if os.getppid() != parent:
                return
        try:
            job = conn.recv()
        except (EOFError, ConnectionResetError):  # the trainer died (e.g. SIGKILL)
            return
        if job is None:
            return
        try:
            conn.send(("ok", run_job(job, maps, parent)))
        except (ParentGone, BrokenPipeError, ConnectionResetError):
            return
        except BaseException as e:  # reported to the parent, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        maps.prune()


if __name__ == "__main__":
    main(int(sys.argv[1]))
