"""How much of a checkpoint a save or load left in the page cache.

:func:`residency` counts the resident pages of each file with ``mincore(2)`` over a
``PROT_READ`` shared mapping of it (``fincore``'s method: mapping without touching faults
nothing in, so the count is what the kernel holds). Where ``mincore`` cannot be called (no
libc symbol, or the kernel refuses it), it falls back to how much ``/proc/meminfo``'s
``Cached`` grew since a :func:`cached_now` taken before the save or load: cruder (other
processes move it too), and named as such in :attr:`Residency.method`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

from dcp_plus.cli.bench.machine import files_under

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Residency:
    """Bytes of some files in the page cache, of their total size, and how it was counted."""

    resident: int
    total: int
    method: str  # "mincore" | "meminfo Cached delta"

    @property
    def fraction(self) -> float:
        """``resident / total`` (0 for no bytes)."""
        return self.resident / self.total if self.total else 0.0


class _Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)
        self.mmap, self.munmap, self.mincore = lib.mmap, lib.munmap, lib.mincore
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_ubyte)]


def _libc() -> _Libc | None:
    try:
        return _Libc()
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
_BIT0 = bytes(i & 1 for i in range(256))


def resident_bytes(path: str) -> int:
    """Bytes of file ``path`` in the page cache (whole pages; the last one counts in full up
    to the file's size). Raises OSError where ``mincore`` is unavailable or refused."""
    if _LIBC is None:
        raise OSError(f"{path}: mincore is not available in this process's libc")
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            e = ctypes.get_errno()
            raise OSError(e, f"mmap of {path} for mincore: {os.strerror(e)}")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(addr, size, vec) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"mincore of {path}: {os.strerror(e)}")
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)
    resident = bytes(vec).translate(_BIT0).count(1)  # bit 0: resident; the rest reserved
    return resident * PAGE - (pages * PAGE - size if vec[pages - 1] & 1 else 0)


def cached_now() -> int:
    """``Cached`` of ``/proc/meminfo`` in bytes: the baseline of :func:`residency`'s fallback."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no Cached line")


def residency(paths: list[str], baseline: int | None = None) -> Residency:
    """How many bytes of the files at/under ``paths`` are in the page cache, of their size.

    ``mincore`` per file; where that fails and ``baseline`` (a :func:`cached_now` from before
    the I/O) is given, the growth of ``Cached`` since then, at most the files' size.
    """
    files = files_under(paths)
    total = sum(os.path.getsize(f) for f in files)
    try:
        return Residency(sum(resident_bytes(f) for f in files), total, "mincore")
    except OSError:
        if baseline is None:
            raise
    return Residency(min(total, max(0, cached_now() - baseline)), total,
                     "meminfo Cached delta")
