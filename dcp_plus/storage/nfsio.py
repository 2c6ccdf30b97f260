"""``nfs://`` checkpoints through the user-space NFS client ``nfs-rs``, and picking the store
for an NFS target (an ``nfs://`` URL or a mounted path).

:class:`NfsStore` supplies :class:`~dcp_plus.storage.dirstore.DirStore`'s file primitives;
the algorithms that make the store safe on NFS are documented there.
"""

from __future__ import annotations

import errno
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dcp_plus.storage.dirstore import DirStore, FileStore
from dcp_plus.storage.ranged import StoreConfig, check_small
from dcp_plus.storage.urls import is_url


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


class NfsStore(DirStore):
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
        try:
            import nfs_rs
        except ImportError:
            raise ImportError("nfs:// checkpoints need the user-space NFS client: "
                              "pip install 'dcp-plus[nfs]'") from None
        client_url, self.rel, location = split_nfs_url(url, export)
        super().__init__(location, config)
        opts = dict(options or {})
        if "version" not in parse_qs(urlsplit(url).query) and "versions" not in opts:
            opts["versions"] = ["4.1", "3"]
        self.client = self._retry.call(lambda _: nfs_rs.Client.connect(client_url, **opts),
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
        check_small(self.location(name), self._size(name))
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
    if is_url(str(target)):
        raise ValueError(f"{target}: NFSWriter/NFSReader take a mounted path or an nfs:// URL")
    return FileStore(str(target), config, fsync=fsync)
