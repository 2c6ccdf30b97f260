"""Shared-file-system I/O for checkpoints: a mounted directory, or ``nfs://`` via ``nfs-rs``.

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

import errno
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from dcp_plus.errors import CheckpointFormatError, StorageError
from dcp_plus.format.layout import MAX_RECORD_BYTES
from dcp_plus.storage.fileio import (
    fsync_dir,
    open_regular,
    preadinto_all,
    pwrite_all,
    read_regular,
)
from dcp_plus.storage.objectio import Segments, StoreConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_ERRNOS = frozenset({
    errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.ENOTCONN, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EPIPE,
    errno.EAGAIN,
})
# nfs-rs protocol status names (NFS4ERR_*/NFS3ERR_*) that a retry can cure
_RETRY_STATUS = ("STALE", "_IO", "DELAY", "GRACE", "JUKEBOX", "EXPIRED", "BADSESSION",
                 "DEADSESSION", "SEQ_MISORDERED")
_NO_LINK = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV})
PIECE = 8 << 20  # one pwrite/pread per piece; pieces of one file run in parallel


def is_nfs_retryable(exc: BaseException) -> bool:
    """True for errors a retry can cure: ESTALE, EIO, timeouts, lost connections, NFS DELAY."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in RETRY_ERRNOS:
        return True
    action = getattr(exc, "recovery_action", None)
    if action is not None and str(getattr(action, "value", action)) in ("retry", "reopen"):
        return True
    status = getattr(exc, "code_name", None)
    return isinstance(status, str) and any(s in status.upper() for s in _RETRY_STATUS)


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
    status = getattr(exc, "code_name", None)
    tag = ", ".join(x for x in (name, status if isinstance(status, str) else "") if x)
    return f"{type(exc).__name__}{f' ({tag})' if tag else ''}: {exc}"


def retry_io(fn: Callable[[int], T], config: StoreConfig, what: str) -> T:
    """Run ``fn(attempt)`` until it succeeds, fails for good, or ``max_retries`` run out.

    Raises:
        StorageError: naming ``what``, the attempts and the last error, once a retryable
            error persisted past ``config.retry.max_retries`` retries; other errors pass as
            they are.
    """
    policy = config.retry
    attempt = 0
    while True:
        try:
            return fn(attempt)
        except Exception as e:
            if not is_nfs_retryable(e):
                raise
            if attempt >= policy.max_retries:
                raise StorageError(
                    f"{what} failed after {attempt + 1} attempt(s): {_describe(e)}; the shared "
                    "file system kept failing (stale handles, I/O errors or a lost server): "
                    "check the server and the mount, or raise max_retries") from e
            delay = policy.delay(attempt)
            log.info("%s: %s; retry %d/%d in %.2fs", what, _describe(e), attempt + 1,
                     policy.max_retries, delay)
            time.sleep(delay)
            attempt += 1


def _pieces(segments: Segments) -> list[tuple[int, memoryview]]:
    out = []
    for off, data in segments:
        view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        for a in range(0, len(view), PIECE):
            out.append((off + a, view[a : a + PIECE]))
    return out


class _DirStore:
    """The algorithms; subclasses supply the file primitives for their client."""

    url: str
    config: StoreConfig
    uploads_from_any_process = False  # NFSWriter writes its files itself

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    # -- primitives -------------------------------------------------------------------------
    def _open(self, name: str, write: bool) -> Any:
        raise NotImplementedError

    def _write_at(self, handle: Any, data: memoryview, offset: int) -> None:
        raise NotImplementedError

    def _read_at(self, handle: Any, buf: memoryview, offset: int, what: str) -> None:
        raise NotImplementedError

    def _finish_write(self, handle: Any, size: int) -> None:
        raise NotImplementedError

    def _close(self, handle: Any) -> None:
        raise NotImplementedError

    def _size(self, name: str) -> int:
        raise NotImplementedError

    def _read_all(self, name: str) -> bytes:
        raise NotImplementedError

    def _link(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def _rename(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def _unlink(self, name: str) -> None:
        raise NotImplementedError

    def _listdir(self) -> list[str]:
        raise NotImplementedError

    def _makedirs(self) -> None:
        raise NotImplementedError

    def _sync_dir(self) -> None:
        raise NotImplementedError

    # -- ObjectStore ------------------------------------------------------------------------
    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _map(self, fn: Callable[[Any], T], args: Sequence[Any]) -> list[T]:
        if len(args) <= 1:
            return [fn(a) for a in args]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.concurrency,
                                            thread_name_prefix="dcpp-nfsio")
        futures = [self._pool.submit(fn, a) for a in args]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures]

    def _retry(self, fn: Callable[[int], T], what: str) -> T:
        return retry_io(fn, self.config, what)

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]:
        def size(name: str) -> int | None:
            def attempt(_: int) -> int | None:
                try:
                    return self._size(name)
                except (FileNotFoundError, NotADirectoryError):
                    return None
            return self._retry(attempt, f"size of {self.location(name)}")
        return {n: size(n) for n in names}

    def get(self, name: str) -> bytes | None:
        def attempt(_: int) -> bytes | None:
            try:
                return self._read_all(name)  # to EOF: no size taken first, so no race
            except (FileNotFoundError, NotADirectoryError):
                return None
        return self._retry(attempt, f"read of {self.location(name)}")

    def _write_file(self, name: str, segments: Segments, total: int) -> None:
        pieces = _pieces(segments)

        def attempt(_: int) -> None:
            h = self._open(name, write=True)
            try:
                self._map(lambda p: self._write_at(h, p[1], p[0]), pieces)
                self._finish_write(h, total)
            finally:
                self._close(h)
        self._retry(attempt, f"write of {self.location(name)}")

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
        self._retry(lambda _: self._sync_dir(), f"directory sync of {self.url}")
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
        return self._retry(attempt, f"commit of {self.location(name)}")

    def _exists(self, name: str) -> bool:
        return self.sizes([name])[name] is not None

    def upload(self, objects: Sequence[tuple[str, Segments, int]]) -> None:
        self._makedirs()
        for name, segments, total in objects:
            self._write_file(name, segments, total)
        if objects:
            self._retry(lambda _: self._sync_dir(), f"directory sync of {self.url}")

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None:
        what = self.location(name)
        pieces = _pieces([(off, v) for off, v in reads if len(v)])

        def attempt(_: int) -> None:
            h = self._open(name, write=False)
            try:
                self._map(lambda p: self._read_at(h, p[1], p[0], what), pieces)
            finally:
                self._close(h)
        self._retry(attempt, f"read of {what}")

    def list(self) -> list[str]:
        def attempt(_: int) -> list[str]:
            try:
                return self._listdir()
            except (FileNotFoundError, NotADirectoryError):
                return []
        return self._retry(attempt, f"listing of {self.url}")

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            def attempt(_: int, name: str = name) -> None:
                try:
                    self._unlink(name)
                except FileNotFoundError:
                    pass
            self._retry(attempt, f"removal of {self.location(name)}")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class FileStore(_DirStore):
    """A directory of a mounted (shared) file system, through the OS: pwrite + fsync."""

    def __init__(self, root: str, config: StoreConfig, *, fsync: bool = True) -> None:
        super().__init__()
        self.root = os.path.abspath(root)
        self.url = os.fspath(root).rstrip("/") or "/"
        self.config = config
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


def split_nfs_url(url: str, export: str | None = None) -> tuple[str, str, str]:
    """``nfs://host[:port]/export/dir?opts`` -> (client URL, directory in the export, URL
    without the query, for messages).

    The export is the first path component unless ``export`` names a longer one.
    """
    parts = urlsplit(url)
    if parts.scheme != "nfs" or not parts.hostname:
        raise ValueError(f"{url}: expected nfs://host[:port]/export/path")
    path = parts.path.strip("/")
    exp = (export or path.split("/", 1)[0]).strip("/")
    if not exp or not (path == exp or path.startswith(exp + "/")):
        raise ValueError(f"{url}: the path does not start with the export {exp!r}")
    rel = path[len(exp):].strip("/")
    if not rel:
        raise ValueError(f"{url}: name a directory inside the export, e.g. "
                         f"nfs://{parts.netloc}/{exp}/run/step_100")
    query = f"?{parts.query}" if parts.query else ""
    return f"nfs://{parts.netloc}/{exp}{query}", rel, f"nfs://{parts.netloc}/{path}"


def join_target(target: str, name: str) -> str:
    """``target/name`` for a path or an ``nfs://`` URL (its query string kept at the end)."""
    base, sep, query = str(target).partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{query}"


class NfsStore(_DirStore):
    """A directory of an NFS export through the user-space client ``nfs-rs``.

    ``nfs-rs`` returns from a write only once its bytes are on stable storage (WRITE
    FILE_SYNC or WRITE + COMMIT), and NFS servers commit CREATE/LINK/RENAME before replying,
    so no separate sync call exists or is needed.

    Args:
        url: ``nfs://host[:port]/export/dir?version=4.1&noresvport=true``.
        options: keyword arguments of ``nfs_rs.Client.connect``, passed untouched (without a
            version in the URL or options, NFSv4.1 is tried, then v3).
        export: the export path when it has more than one component.
    """

    def __init__(self, url: str, options: dict[str, Any] | None, config: StoreConfig, *,
                 export: str | None = None) -> None:
        super().__init__()
        try:
            import nfs_rs
        except ImportError:
            raise ImportError("nfs:// checkpoints need the user-space NFS client: "
                              "pip install 'dcp-plus[nfs]'") from None
        client_url, self.rel, self.url = split_nfs_url(url, export)
        self.config = config
        opts = dict(options or {})
        if "version" not in parse_qs(urlsplit(url).query) and "versions" not in opts:
            opts["versions"] = ["4.1", "3"]
        self.client = retry_io(lambda _: nfs_rs.Client.connect(client_url, **opts), config,
                               f"connect to {client_url}")

    def _path(self, name: str) -> str:
        return f"{self.rel}/{name}"

    def _open(self, name: str, write: bool) -> Any:
        return self.client.open(self._path(name), "wb" if write else "rb")

    def _write_at(self, handle: Any, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):  # write_at is durable when it returns
            n = handle.write_at(data[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"write_at returned {n}")
            done += n

    def _read_at(self, handle: Any, buf: memoryview, offset: int, what: str) -> None:
        buf = buf.cast("B") if buf.format != "B" else buf
        n = handle.readinto_at(buf, offset)
        if n < len(buf):
            raise EOFError(f"{what}: unexpected end of file at byte {offset + n}")

    def _finish_write(self, handle: Any, size: int) -> None:
        handle.truncate(size)

    def _close(self, handle: Any) -> None:
        handle.close()

    def _size(self, name: str) -> int:
        return int(self.client.stat(self._path(name)).size)  # GETATTR: nfs-rs keeps no cache

    def _read_all(self, name: str) -> bytes:
        size = self._size(name)
        if size > MAX_RECORD_BYTES:
            raise CheckpointFormatError(f"{self.location(name)}: {size} bytes, more than a "
                                        f"record or extent table may hold ({MAX_RECORD_BYTES})")
        with self.client.open(self._path(name), "rb") as f:
            return bytes(f.read())

    def _link(self, src: str, dst: str) -> None:
        self.client.link(self._path(src), self._path(dst))

    def _rename(self, src: str, dst: str) -> None:
        self.client.rename(self._path(src), self._path(dst))

    def _unlink(self, name: str) -> None:
        self.client.unlink(self._path(name))

    def _listdir(self) -> list[str]:
        return list(self.client.listdir(self.rel))

    def _makedirs(self) -> None:
        self.client.mkdir(self.rel, parents=True, exist_ok=True)

    def _sync_dir(self) -> None:
        pass

    def close(self) -> None:
        super().close()
        self.client.close()


def open_nfs_store(target: str, options: dict[str, Any] | None, config: StoreConfig, *,
                   export: str | None = None, fsync: bool = True) -> FileStore | NfsStore:
    """:class:`NfsStore` for ``nfs://`` URLs, :class:`FileStore` for mounted paths."""
    if str(target).startswith("nfs://"):
        return NfsStore(str(target), options, config, export=export)
    if "://" in str(target):
        raise ValueError(f"{target}: NFSWriter/NFSReader take a mounted path or an nfs:// URL")
    return FileStore(str(target), config, fsync=fsync)
