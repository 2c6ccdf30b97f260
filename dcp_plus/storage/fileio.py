"""Durable file primitives (torch-free: worker processes import this)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.storage.rate import GRANT

CHUNK = 64 << 20  # bounded syscalls: progress checks between them stay responsive
COALESCE_GAP = 64 << 10
MAX_IOV = 512


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Re-raise an ``OSError`` that names no file (``os.pwrite``'s, ``os.fsync``'s) with
    ``path``: "No space left on device" alone does not say where."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


def pwrite_all(fd: int, data: memoryview, offset: int,
               between_chunks: Callable[[], None] | None = None,
               pace: Callable[[int], None] | None = None) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked); with ``pace``
    (a rate cap's ``Bucket.take``), in :data:`~dcp_plus.storage.rate.GRANT` pieces, each
    paced before it is sent."""
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    chunk = CHUNK if pace is None else GRANT
    done = 0
    while done < len(data):
        if pace is not None:
            pace(min(chunk, len(data) - done))
        n = os.pwrite(fd, data[done : done + chunk], offset + done)
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


def read_coalesced(fd: int, path: str, reads: list[tuple[int, memoryview]]) -> None:
    """Fill each ``(offset, buffer)``; neighbours within 64 KiB share one preadv call.

    Empty buffers read nothing: their offset may lie past the end of the file (an empty value
    placed, aligned, after the file's last byte).
    """
    reads = sorted((r for r in reads if len(r[1])), key=lambda r: r[0])
    i = 0
    while i < len(reads):
        start = reads[i][0]
        iov: list[memoryview] = [reads[i][1]]
        end = start + len(reads[i][1])
        j = i + 1
        while j < len(reads) and len(iov) < MAX_IOV - 1:
            off, buf = reads[j]
            gap = off - end
            if gap < 0 or gap > COALESCE_GAP:
                break
            if gap:
                iov.append(memoryview(bytearray(gap)))
            iov.append(buf)
            end = off + len(buf)
            j += 1
        total = end - start
        n = os.preadv(fd, iov, start) if total else 0
        if n < total:  # short read: finish buffer by buffer (raises EOFError at a real end)
            pos = start
            for buf in iov:
                if pos + len(buf) > start + n:
                    skip = max(0, start + n - pos)
                    preadinto_all(fd, buf[skip:], pos + skip, path)
                pos += len(buf)
        i = j


def fsync_dir(path: str) -> None:
    """fsync a directory so that the names created in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_tmp(path: str, data: bytes, tmp_suffix: str, durable: bool = True) -> str:
    tmp = f"{path}.{tmp_suffix}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pwrite_all(fd, memoryview(data), 0)
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def atomic_write(path: str, data: bytes, tmp_suffix: str, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: tmp + fsync + rename + directory fsync (without
    ``durable``: tmp + rename only, for throwaway checkpoints)."""
    os.rename(_durable_tmp(path, data, tmp_suffix, durable), path)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_create(path: str, data: bytes, tmp_suffix: str) -> bool:
    """:func:`atomic_write`, but only if ``path`` does not exist (a hard link, which never
    replaces and is atomic on NFS too); False if it does."""
    tmp = _durable_tmp(path, data, tmp_suffix)
    try:
        os.link(tmp, path)
    except FileExistsError:
        # on NFS a retransmitted LINK whose first reply was lost answers EEXIST: the link
        # is ours if the temporary file has two names now
        ours = os.stat(tmp).st_nlink == 2
        os.unlink(tmp)
        if not ours:
            return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
            os.unlink(tmp)
            raise
        if os.path.lexists(path):  # no hard links here: check, then rename (not atomic)
            os.unlink(tmp)
            return False
        os.rename(tmp, path)
    else:
        os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return True


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_KINDS = {stat.S_IFDIR: "directory", stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device",
          stat.S_IFBLK: "block device", stat.S_IFSOCK: "socket", stat.S_IFLNK: "symbolic link"}


def open_regular(directory: str, name: str) -> int:
    """Open ``directory/name`` read-only, only if it is a regular file reached without
    following a symbolic link below ``directory`` (``name`` may have ``/`` components).

    The open never blocks (a FIFO is refused, not waited on). The caller closes the fd.

    Raises:
        FileNotFoundError, NotADirectoryError: there is no such file.
        CheckpointFormatError: it is a symbolic link, FIFO, device, socket or directory.
    """
    path = os.path.join(directory, name)
    parts = name.split("/")
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC,
                              dir_fd=dir_fd)
            except OSError as e:
                # O_NOFOLLOW | O_DIRECTORY on a symlink fails with ELOOP or ENOTDIR
                if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and stat.S_ISLNK(
                        os.lstat(part, dir_fd=dir_fd).st_mode)):
                    raise CheckpointFormatError(
                        f"{path}: {part!r} is a symbolic link, which could lead outside the "
                        "checkpoint directory; refusing to read through it") from None
                raise
            os.close(dir_fd)
            dir_fd = sub
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC,
                         dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointFormatError(
                    f"{path}: is a symbolic link, which could lead outside the checkpoint "
                    "directory; checkpoint files are regular files, so it is not followed"
                ) from None
            raise
    finally:
        os.close(dir_fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "special file")
        raise CheckpointFormatError(f"{path}: is a {kind}, not a regular file; refusing to "
                                    "read it")
    return fd


def read_regular(directory: str, name: str, limit: int) -> bytes:
    """The whole of regular file ``directory/name`` (see :func:`open_regular`), refused
    without reading when it is larger than ``limit`` bytes."""
    fd = open_regular(directory, name)
    try:
        size = os.fstat(fd).st_size
        path = os.path.join(directory, name)
        if size > limit:
            raise CheckpointFormatError(f"{path}: {size} bytes, more than the {limit} a file "
                                        "of this kind may hold; refusing to read it")
        buf = bytearray(size)
        preadinto_all(fd, memoryview(buf), 0, path)
        return bytes(buf)
    finally:
        os.close(fd)
