"""A directory as an object store: the algorithms for shared file systems, and the mounted
directory (:class:`FileStore`; ``nfs://`` through ``nfs-rs`` is
:class:`~dcp_plus.storage.nfsio.NfsStore`).

Both stores implement :class:`~dcp_plus.storage.objectio.ObjectStore`, so the object-store
writer and reader drive them unchanged. What makes them safe on NFS:

- No O_DIRECT, no mmap, no locks: positional writes and reads only.
- Data files are written whole (``pwrite``s in parallel, then ``fsync``); a retryable
  failure (ESTALE, EIO, timeouts, lost connections) reopens the file and writes it again
  from the start, because after a failed ``fsync`` the kernel may already have dropped the
  dirty pages, so a second ``fsync`` proves nothing.
- Small files (extent tables, the commit record) are written to a temporary name, synced,
  then linked (``if_absent``: ``link`` fails atomically with EEXIST, also on NFS) or renamed
  (overwrite) onto their final name; the directory is fsynced. A link or rename whose reply
  was lost is verified by reading the target back before it is retried.
- Sizes and existence are read by opening the file: close-to-open consistency makes an NFS
  client revalidate the attributes on open, where a ``stat`` may answer from its cache.
- Every operation is retried at most ``RetryPolicy.max_retries`` times, then fails with a
  :class:`~dcp_plus.errors.StorageError` naming the file, the attempts and the errno.
"""

from __future__ import annotations

import abc
import errno
import os
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from dcp_plus.errors import StorageError
from dcp_plus.format.layout import MAX_RECORD_BYTES
from dcp_plus.storage.fanout import Threads
from dcp_plus.storage.fileio import (
    fsync_dir,
    open_regular,
    preadinto_all,
    pwrite_all,
    read_regular,
)
from dcp_plus.storage.nfs_errors import NFS_ERRORS
from dcp_plus.storage.ranged import Segments, StoreConfig
from dcp_plus.storage.rate import GRANT, Bucket
from dcp_plus.storage.retry import Retry

_NO_LINK = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV})
PIECE = 8 << 20  # one pwrite/pread per piece; pieces of one file run in parallel
_MISSING = (FileNotFoundError, NotADirectoryError)
T = TypeVar("T")


def _pieces(segments: Segments, size: int = PIECE) -> list[tuple[int, memoryview]]:
    out = []
    for off, data in segments:
        view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        for a in range(0, len(view), size):
            out.append((off + a, view[a : a + size]))
    return out


class DirStore(abc.ABC):
    """The algorithms; subclasses supply the file primitives for their client.

    Args:
        url: the directory, as named in messages.
        config: ``concurrency`` bounds the parallel writes and reads of one file,
            ``retry`` every operation.
    """

    uploads_from_any_process = False  # NFSWriter writes its files itself

    def __init__(self, url: str, config: StoreConfig) -> None:
        self.url = url
        self.config = config
        self._threads = Threads(config.concurrency, "dcpp-nfsio")
        self._retry = Retry(config.retry, NFS_ERRORS)

    # -- primitives -------------------------------------------------------------------------
    @abc.abstractmethod
    def _open(self, name: str, write: bool) -> Any:
        ...

    @abc.abstractmethod
    def _write_at(self, handle: Any, data: memoryview, offset: int) -> None:
        ...

    @abc.abstractmethod
    def _read_at(self, handle: Any, buf: memoryview, offset: int, what: str) -> None:
        ...

    @abc.abstractmethod
    def _finish_write(self, handle: Any, size: int) -> None:
        ...

    @abc.abstractmethod
    def _close(self, handle: Any) -> None:
        ...

    @abc.abstractmethod
    def _size(self, name: str) -> int:
        ...

    @abc.abstractmethod
    def _read_all(self, name: str) -> bytes:
        ...

    @abc.abstractmethod
    def _link(self, src: str, dst: str) -> None:
        ...

    @abc.abstractmethod
    def _rename(self, src: str, dst: str) -> None:
        ...

    @abc.abstractmethod
    def _unlink(self, name: str) -> None:
        ...

    @abc.abstractmethod
    def _listdir(self) -> list[str]:
        ...

    @abc.abstractmethod
    def _makedirs(self) -> None:
        ...

    @abc.abstractmethod
    def _sync_dir(self) -> None:
        ...

    # -- ObjectStore ------------------------------------------------------------------------
    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _unless_missing(self, fn: Callable[[], T], missing: T, what: str,
                        kinds: tuple[type[OSError], ...] = _MISSING) -> T:
        """``fn()``, retried; ``missing`` if the file (or a directory on its path) is not
        there."""
        def attempt(_: int) -> T:
            try:
                return fn()
            except kinds:
                return missing
        return self._retry.call(attempt, what)

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]:
        return {n: self._unless_missing(partial(self._size, n), None,
                                        f"size of {self.location(n)}") for n in names}

    def get(self, name: str) -> bytes | None:
        # _read_all reads to EOF: no size is taken first, so none can race a writer
        return self._unless_missing(partial(self._read_all, name), None,
                                    f"read of {self.location(name)}")

    def _write_file(self, name: str, segments: Segments, total: int,
                    pace: Bucket | None = None) -> None:
        pieces = _pieces(segments, PIECE if pace is None else GRANT)

        def write(h: Any, piece: tuple[int, memoryview]) -> None:
            if pace is not None:
                pace.take(len(piece[1]))
            self._write_at(h, piece[1], piece[0])

        def attempt(_: int) -> None:  # a rewrite after a failure is paced again
            h = self._open(name, write=True)
            try:
                self._threads.map(partial(write, h), pieces)
                self._finish_write(h, total)
            finally:
                self._close(h)
        self._retry.call(attempt, f"write of {self.location(name)}")

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool:
        """Write ``name`` atomically: temporary file, synced, then link (``if_absent``) or
        rename onto ``name``. Returns False if ``if_absent`` and ``name`` exists."""
        self._makedirs()
        tmp = f"{name}.{uuid.uuid4().hex[:12]}.tmp"
        self._write_file(tmp, [(0, memoryview(data))], len(data))
        try:
            placed = self._place(tmp, name, data, if_absent)
        finally:
            self.delete([tmp])  # gone already after a rename
        self._retry.call(lambda _: self._sync_dir(), f"directory sync of {self.url}")
        return placed

    def _place(self, tmp: str, name: str, data: bytes, if_absent: bool) -> bool:
        def ours() -> bool:  # did a link/rename whose reply was lost take effect?
            try:
                return self.get(name) == data
            except StorageError:
                return False

        def attempt(n: int) -> bool:
            if n and ours():
                return True
            if not if_absent:
                self._rename(tmp, name)
                return True
            try:
                self._link(tmp, name)
                return True
            except FileExistsError:
                return n > 0 and ours()
            except OSError as e:
                if e.errno not in _NO_LINK:
                    raise
            # no hard links on this file system: check, then rename (not atomic)
            if self._exists(name):
                return False
            self._rename(tmp, name)
            return True
        return self._retry.call(attempt, f"commit of {self.location(name)}")

    def _exists(self, name: str) -> bool:
        return self.sizes([name])[name] is not None

    def upload(self, objects: Sequence[tuple[str, Segments, int]],
               pace: Bucket | None = None) -> None:
        self._makedirs()
        for name, segments, total in objects:
            self._write_file(name, segments, total, pace)
        if objects:
            self._retry.call(lambda _: self._sync_dir(), f"directory sync of {self.url}")

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None:
        what = self.location(name)
        pieces = _pieces([(off, v) for off, v in reads if len(v)])

        def attempt(_: int) -> None:
            h = self._open(name, write=False)
            try:
                self._threads.map(lambda p: self._read_at(h, p[1], p[0], what), pieces)
            finally:
                self._close(h)
        self._retry.call(attempt, f"read of {what}")

    def list(self) -> list[str]:
        return self._unless_missing(self._listdir, [], f"listing of {self.url}")

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            self._unless_missing(partial(self._unlink, name), None,
                                 f"removal of {self.location(name)}", (FileNotFoundError,))

    def close(self) -> None:
        self._threads.close()


class FileStore(DirStore):
    """A directory of a mounted (shared) file system, through the OS: pwrite + fsync."""

    def __init__(self, root: str, config: StoreConfig, *, fsync: bool = True) -> None:
        super().__init__(os.fspath(root).rstrip("/") or "/", config)
        self.root = os.path.abspath(root)
        self.fsync = fsync

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _open(self, name: str, write: bool) -> int:
        if not write:
            return open_regular(self.root, name)  # never a FIFO, device or symlink
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        return os.open(self._path(name), flags, 0o644)

    def _write_at(self, handle: int, data: memoryview, offset: int) -> None:
        pwrite_all(handle, data, offset)

    def _read_at(self, handle: int, buf: memoryview, offset: int, what: str) -> None:
        preadinto_all(handle, buf, offset, what)

    def _finish_write(self, handle: int, size: int) -> None:
        os.ftruncate(handle, size)
        if self.fsync:
            os.fsync(handle)

    def _close(self, handle: int) -> None:
        os.close(handle)

    def _size(self, name: str) -> int:
        fd = open_regular(self.root, name)  # open: close-to-open revalidation
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _read_all(self, name: str) -> bytes:
        return read_regular(self.root, name, MAX_RECORD_BYTES)

    def _link(self, src: str, dst: str) -> None:
        os.link(self._path(src), self._path(dst))

    def _rename(self, src: str, dst: str) -> None:
        os.rename(self._path(src), self._path(dst))

    def _unlink(self, name: str) -> None:
        os.unlink(self._path(name))

    def _listdir(self) -> list[str]:
        return os.listdir(self.root)

    def _makedirs(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def _sync_dir(self) -> None:
        if self.fsync:
            fsync_dir(self.root)
