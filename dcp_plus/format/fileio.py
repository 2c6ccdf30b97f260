"""Durable file primitives (torch-free: worker processes import this)."""

from __future__ import annotations

import os
from collections.abc import Callable

CHUNK = 64 << 20  # bounded syscalls: progress checks between them stay responsive


def pwrite_all(fd: int, data: memoryview, offset: int,
               between_chunks: Callable[[], None] | None = None) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked)."""
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + CHUNK], offset + done)
        if n <= 0:
            raise OSError(f"pwrite returned {n}")
        done += n
        if between_chunks is not None:
            between_chunks()


def preadinto_all(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` from ``offset``; a short file raises EOFError naming ``path``."""
    buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done : done + CHUNK]], offset + done)
        if n == 0:
            raise EOFError(f"{path}: unexpected end of file at byte {offset + done}")
        done += n


def fsync_dir(path: str) -> None:
    """fsync a directory so that the names created in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, tmp_suffix: str) -> None:
    """Write ``data`` to ``path`` atomically: tmp + fsync + rename + directory fsync."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.{tmp_suffix}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    fsync_dir(directory)
