"""Low-level pieces of reading with ``O_DIRECT`` (torch-free): whether a descriptor can, page-
aligned bounce buffers, positional reads that stop at the end of the file, GIL-free copies,
and page-cache residency (``mincore``).

``O_DIRECT`` needs the buffer address, the file offset and the length aligned (to the device's
logical block, <= 4 KiB): every read here is 4 KiB-aligned.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any, Literal

DIRECT_ALIGN = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # Linux (and a few others) only

DirectIO = bool | Literal["auto"]
"""``direct_io`` settings: True (try O_DIRECT), False (page cache), "auto" (O_DIRECT unless the
files live in memory anyway: tmpfs, ramfs)."""

_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type magics
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MAP_FAILED = ctypes.c_void_p(-1).value


def direct_io_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a ``direct_io`` setting, or None."""
    if value is True or value is False or value == "auto":
        return None
    return f'must be True, False or "auto", got {value!r}'


def memory_fs(fd: int) -> str | None:
    """The name of the file system of ``fd`` when its files live in memory (tmpfs, ramfs:
    O_DIRECT bypasses nothing there), else None."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        return None
    return _MEMORY_FS.get(struct.unpack_from("l", buf)[0])  # f_type comes first


def is_refusal(error: OSError) -> bool:
    """Whether ``error`` (from an open, fcntl or read) says the file system has no O_DIRECT."""
    return error.errno in _REFUSED


def set_direct(fd: int, on: bool = True) -> OSError | None:
    """Turn O_DIRECT on (or off) for ``fd``; the refusal when the file system has none."""
    if not O_DIRECT:
        return OSError(errno.EOPNOTSUPP, "this platform has no O_DIRECT")
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
    except OSError as e:
        if is_refusal(e):
            return e
        raise
    return None


def address(view: memoryview | mmap.mmap) -> int:
    """The address of a writable, non-empty buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def is_aligned(view: memoryview) -> bool:
    """Whether ``view`` may be an O_DIRECT target: non-empty, writable, 4 KiB-aligned."""
    return len(view) > 0 and not view.readonly and address(view) % DIRECT_ALIGN == 0


def copy_bytes(dst: int, src: int, n: int) -> None:
    """memmove ``n`` bytes between addresses (without the GIL, unlike a memoryview copy)."""
    ctypes.memmove(dst, src, n)


def pread_upto(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` as far as the file goes; the bytes read. Aligned
    ``view`` and ``offset`` stay aligned: a short O_DIRECT read only happens at the end."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
        if done % DIRECT_ALIGN:  # ended inside a block: the end of the file
            break
    return done


class BouncePool:
    """Reusable page-aligned buffers of ``size`` bytes, one per concurrent user."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[mmap.mmap, int]] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self) -> Iterator[tuple[memoryview, int]]:
        """A buffer (and its address) for the duration of the ``with``."""
        with self._lock:
            item = self._free.pop() if self._free else None
        if item is None:
            buf = mmap.mmap(-1, self.size)  # anonymous mappings are page-aligned
            item = (buf, address(buf))
        view = memoryview(item[0])
        try:
            yield view, item[1]
        finally:
            view.release()
            with self._lock:
                self._free.append(item)

    def close(self) -> None:
        """Unmap the buffers not in use."""
        with self._lock:
            free, self._free = self._free, []
        for buf, _ in free:
            buf.close()


def resident_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(bytes of the file in the page cache, file size)``, by ``mincore`` on a mapping of
    it (whole pages: the last one counts in full)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"{path}: mmap failed")
        try:
            page = mmap.PAGESIZE
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"{path}: mincore failed")
            return sum(v & 1 for v in vec) * page, size
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
