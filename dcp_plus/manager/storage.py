"""Storage backends of the manager, chosen by the root's URL scheme.

A backend builds the DCP writer and reader for one checkpoint and does the few directory
operations the manager needs (list, commit check, delete, the ``latest`` pointer). Local paths
and ``file://`` URLs use :class:`LocalBackend`; object stores and other fsspec URLs use
:class:`~dcp_plus.manager.object_backend.ObjectStoreBackend`. ``register_scheme`` adds more.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_plus.errors import DcpPlusError, InvalidOptionError
from dcp_plus.format.record import RECORD_NAME
from dcp_plus.manager.lease import MAX_LEASE_RECORD_BYTES, LeaseStore
from dcp_plus.manager.options import LocalReaderOptions, LocalWriterOptions
from dcp_plus.storage.fileio import atomic_write, fsync_dir
from dcp_plus.storage.localfs import LocalFileStore
from dcp_plus.storage.urls import is_url


class Backend(Protocol):
    """What the manager needs from a storage location."""

    writer_options: type[Any]
    """The settings class of its writer (e.g. ``LocalWriterOptions``): ``writer()`` takes
    that class's ``kwargs()`` (and ``fence``)."""
    reader_options: type[Any]
    """Likewise for its reader."""

    def join(self, root: str, name: str) -> str: ...
    def writer(self, path: str, options: Mapping[str, Any]) -> StorageWriter: ...
    def reader(self, path: str, options: Mapping[str, Any]) -> StorageReader: ...
    def makedirs(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def is_committed(self, path: str) -> bool: ...
    def verify(self, path: str) -> list[str]: ...
    def uncommit(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def read(self, path: str) -> bytes | None: ...
    def write_atomic(self, path: str, data: bytes) -> None: ...
    def lease_store(self, path: str) -> LeaseStore: ...


class FileLeaseStore:
    """Lease records in a directory (local or mounted, NFS included): exclusive create by
    hard link, which is atomic on NFS too; replacement by rename."""

    def __init__(self, directory: str) -> None:
        self.location = directory
        self._files = LocalFileStore(directory, max_get=MAX_LEASE_RECORD_BYTES)

    def create(self, name: str, data: bytes) -> bool:
        os.makedirs(self.location, exist_ok=True)
        return self._files.put(name, data, if_absent=True)

    def write(self, name: str, data: bytes) -> None:
        self._files.put(name, data, if_absent=False)

    def read(self, name: str) -> bytes | None:
        return self._files.get(name)

    def list(self) -> list[str]:
        return [n for n in self._files.list() if not n.endswith(".tmp")]

    def delete(self, names: Sequence[str]) -> None:
        self._files.delete(names)


class LocalBackend:
    """A local or mounted directory: :class:`~dcp_plus.LocalWriter` / ``LocalReader``."""

    writer_options = LocalWriterOptions
    reader_options = LocalReaderOptions

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        if storage_options:
            raise ValueError(f"local paths take no storage_options, got {dict(storage_options)}")

    def join(self, root: str, name: str) -> str:
        return os.path.join(root, name)

    def writer(self, path: str, options: Mapping[str, Any]) -> StorageWriter:
        from dcp_plus.writers import LocalWriter

        return LocalWriter(path, **{"overwrite": True, **options})

    def reader(self, path: str, options: Mapping[str, Any]) -> StorageReader:
        from dcp_plus.readers import LocalReader

        return LocalReader(path, **options)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def is_committed(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, RECORD_NAME))

    def verify(self, path: str) -> list[str]:
        from dcp_plus.readers.inspect import verify

        try:
            return verify(path).problems
        except (OSError, ValueError, DcpPlusError) as e:  # unreadable / malformed record
            return [f"{path}: {e}"]

    def uncommit(self, path: str) -> None:
        """Remove the commit record first: from then on the checkpoint no longer exists."""
        try:
            os.unlink(os.path.join(path, RECORD_NAME))
        except FileNotFoundError:
            return
        fsync_dir(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=False)

    def read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_atomic(self, path: str, data: bytes) -> None:
        atomic_write(path, data, uuid.uuid4().hex[:12])

    def lease_store(self, path: str) -> LeaseStore:
        return FileLeaseStore(path)


def _object_store(storage_options: Mapping[str, Any] | None) -> Backend:
    from dcp_plus.manager.object_backend import ObjectStoreBackend

    return ObjectStoreBackend(storage_options)


BackendFactory = Callable[[Mapping[str, Any]], Backend]
_SCHEMES: dict[str, BackendFactory] = {
    "": LocalBackend, "file": LocalBackend,
    **{s: _object_store for s in ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")},
}


def register_scheme(scheme: str, factory: BackendFactory) -> None:
    """Make roots ``scheme://...`` use the backend ``factory(storage_options)`` builds (a
    :class:`Backend`: it names the settings classes of its writer and reader)."""
    _SCHEMES[scheme] = factory


def split_root(root: str | os.PathLike) -> tuple[str, str]:
    """``(scheme, location)``: ``file:///x`` -> ``("file", "/x")``, ``./x`` -> ``("", "./x")``."""
    text = os.fspath(root)
    if not is_url(text):
        return "", text
    scheme, rest = text.split("://", 1)
    if scheme == "file":
        return scheme, rest
    return scheme, text


def backend_for(root: str | os.PathLike,
                storage_options: Mapping[str, Any] | None = None) -> tuple[Backend, str]:
    """The backend for ``root`` and the location string it works with."""
    scheme, location = split_root(root)
    if scheme not in _SCHEMES:
        known = ", ".join(sorted(f"{s}://" for s in _SCHEMES if s)) or "none"
        raise InvalidOptionError(f"{os.fspath(root)}: no checkpoint backend for {scheme}:// (known: "
                         f"{known}); pass a local directory or register_scheme() one")
    return _SCHEMES[scheme](storage_options or {}), location
