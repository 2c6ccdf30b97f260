"""The object-store interface of checkpoints, and the store for any fsspec URL.

:func:`open_store` picks :class:`~dcp_plus.storage.s3io.S3Store` (parallel multipart uploads and
ranged GETs on s3fs's event loop) for ``s3://`` and
:class:`~dcp_plus.storage.fsspec_store.FsspecStore` (threads over the generic fsspec API) for
everything else (``memory://``, ``file://``, ``gs://``...). Endpoints and credentials only
ever come from fsspec ``storage_options``.

Both stores see an object as ``segments``: ``(offset, bytes)`` pairs, zero-filled between
(:mod:`dcp_plus.storage.ranged`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, runtime_checkable

from dcp_plus.storage.fsspec_store import FsspecStore
from dcp_plus.storage.ranged import Segments, StoreConfig
from dcp_plus.storage.rate import Bucket

__all__ = ["ExtentStore", "ObjectStore", "StoreConfig", "open_store"]


class ObjectStore(Protocol):
    """The few operations a checkpoint needs from a prefix of an object store."""

    url: str
    uploads_from_any_process: bool
    """Whether another process (a writer worker) given the same URL and options reaches the
    same objects: True for network stores, False for ``memory://`` (one per process)."""

    def location(self, name: str) -> str: ...

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]: ...

    def get(self, name: str) -> bytes | None:
        """A small object (record, extent table) whole; None if absent. Objects larger than
        ``MAX_RECORD_BYTES`` are refused (``CheckpointFormatError``) before being read."""
        ...

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool: ...

    def upload(self, objects: Sequence[tuple[str, Segments, int]],
               pace: Bucket | None = None) -> None:
        """Write each ``(name, segments, size)`` whole. With ``pace`` (a rate cap) each
        write or request waits for its bytes' share of the budget before it is sent."""
        ...

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None: ...

    def list(self) -> list[str]: ...

    def delete(self, names: Sequence[str]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ExtentStore(ObjectStore, Protocol):
    """A store that reads a whole checkpoint's extents as one pipeline of requests."""

    def read_extents(self, extents: Sequence[tuple[str, int, int]],
                     open_extent: Callable[[int], memoryview], done: Callable[[int], None],
                     executor: Executor | None = None) -> None:
        """Read whole extents ``(object name, offset, length)``, ``k`` indexing ``extents``.

        ``open_extent(k)`` returns the buffer extent ``k`` is read into; it is called just
        before the first request for ``k`` starts (in request order, at most ``concurrency``
        requests ahead). ``done(k)`` is called once all of ``k``'s bytes are in: on
        ``executor`` if given, else on the thread that completed the read. Empty extents are
        neither opened nor done. The first failure cancels the requests still to come and
        is raised (``EOFError`` for an object that ends before an extent does).
        """
        ...


def open_store(url: str, storage_options: dict[str, Any] | None,
               config: StoreConfig) -> ObjectStore:
    """The store for ``url``'s prefix; ``storage_options`` go to fsspec untouched."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if {"s3", "s3a"} & set(protocols) and hasattr(fs, "set_session"):
        from dcp_plus.storage.s3io import S3Store

        return S3Store(fs, root, url, config)
    return FsspecStore(fs, root, url, config)
