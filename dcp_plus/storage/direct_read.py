"""Low-level pieces of reading with ``O_DIRECT`` (torch-free): whether a descriptor can, page-
aligned bounce buffers, positional reads that stop at the end of the file, GIL-free copies,
(page-cache residency, the setting and the constants are :mod:`dcp_plus.storage.direct`'s).

``O_DIRECT`` needs the buffer address, the file offset and the length aligned (to the device's
logical block, <= 4 KiB): every read here is 4 KiB-aligned.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct

from dcp_plus.storage.direct import ALIGN as DIRECT_ALIGN
from dcp_plus.storage.direct import REFUSALS, DirectIO, direct_io_problem, resident_bytes

__all__ = ["DIRECT_ALIGN", "DirectIO", "direct_io_problem", "resident_bytes"]

O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # Linux (and a few others) only

_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type magics
_libc = ctypes.CDLL(None, use_errno=True)


def memory_fs(fd: int) -> str | None:
    """The name of the file system of ``fd`` when its files live in memory (tmpfs, ramfs:
    O_DIRECT bypasses nothing there), else None."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
    if _libc.fstatfs(fd, buf) != 0:
        return None
    return _MEMORY_FS.get(struct.unpack_from("l", buf)[0])  # f_type comes first


def is_refusal(error: OSError) -> bool:
    """Whether ``error`` (from an open, fcntl or read) says the file system has no O_DIRECT."""
    return error.errno in REFUSALS


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


def copy_bytes(dst: int, src: int, n: int) -> None:
    """memmove ``n`` bytes between addresses (without the GIL, unlike a memoryview copy)."""
    ctypes.memmove(dst, src, n)


IOV_MAX = 1024
"""The most buffers one ``preadv`` takes (Linux ``UIO_MAXIOV``)."""


def preadv_upto(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in turn from ``offset`` as far as the file goes, :data:`IOV_MAX` of
    them per call; the bytes read (a short O_DIRECT read of aligned views only happens at
    the end of the file)."""
    views = [v for v in views if len(v)]
    total = sum(len(v) for v in views)
    done = 0
    while views:
        n = os.preadv(fd, views if len(views) <= IOV_MAX else views[:IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        if done % DIRECT_ALIGN or done == total:
            break
        while n and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return done
