"""The manager's backend for object stores and other fsspec URLs (``s3://``, ``gs://``,
``memory://`` ...): :class:`~dcp_plus.ObjectStoreWriter` / ``ObjectStoreReader``."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_plus.errors import DcpPlusError
from dcp_plus.format.record import RECORD_NAME, decode_record
from dcp_plus.manager.lease import MAX_LEASE_RECORD_BYTES, LeaseStore
from dcp_plus.manager.options import ObjectStoreReaderOptions, ObjectStoreWriterOptions
from dcp_plus.storage.objectio import ObjectStore, StoreConfig, open_store


class ObjectStoreBackend:
    """Checkpoints under a URL prefix; ``storage_options`` go to fsspec untouched.

    There are no directories or renames: a checkpoint exists iff its ``.metadata`` object
    does, and the ``latest`` pointer is one PUT (atomic on object stores).
    """

    writer_options = ObjectStoreWriterOptions
    reader_options = ObjectStoreReaderOptions

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None

    def _fs_path(self, url: str) -> tuple[Any, str]:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
        if self._fs is None:
            self._fs = fs
        return self._fs, path

    def join(self, root: str, name: str) -> str:
        return f"{root.rstrip('/')}/{name}"

    def writer(self, path: str, options: Mapping[str, Any]) -> StorageWriter:
        from dcp_plus.writers import ObjectStoreWriter

        return ObjectStoreWriter(path, self.storage_options, **{"overwrite": True, **options})

    def reader(self, path: str, options: Mapping[str, Any]) -> StorageReader:
        from dcp_plus.readers import ObjectStoreReader

        return ObjectStoreReader(path, self.storage_options, **options)

    def makedirs(self, path: str) -> None:
        """Prefixes need no creation."""

    def listdir(self, path: str) -> list[str]:
        fs, p = self._fs_path(path)
        try:
            return sorted({posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)})
        except FileNotFoundError:
            return []

    def is_committed(self, path: str) -> bool:
        fs, p = self._fs_path(self.join(path, RECORD_NAME))
        return bool(fs.exists(p))

    def verify(self, path: str) -> list[str]:
        """The record parses and every extent lies inside an existing object (checksums are
        verified while loading, which reads every byte anyway)."""
        fs, p = self._fs_path(path)
        try:
            md = decode_record(fs.cat_file(f"{p}/{RECORD_NAME}"), self.join(path, RECORD_NAME))
            problems = []
            sizes: dict[str, int | None] = {}
            for index, ext in md.storage_data.items():
                if ext.file not in sizes:
                    try:
                        sizes[ext.file] = int(fs.size(f"{p}/{ext.file}"))
                    except FileNotFoundError:
                        sizes[ext.file] = None
                size = sizes[ext.file]
                if size is None or ext.offset + ext.length > size:
                    problems.append(f"{self.join(path, ext.file)}: extent of {index.fqn!r} "
                                    f"missing or past the end ({size} bytes)")
            return problems
        except (OSError, ValueError, DcpPlusError) as e:
            return [f"{path}: {e}"]

    def uncommit(self, path: str) -> None:
        fs, p = self._fs_path(self.join(path, RECORD_NAME))
        try:
            fs.rm_file(p)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        fs, p = self._fs_path(path)
        try:
            fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass

    def read(self, path: str) -> bytes | None:
        fs, p = self._fs_path(path)
        try:
            return bytes(fs.cat_file(p))
        except FileNotFoundError:
            return None

    def write_atomic(self, path: str, data: bytes) -> None:
        fs, p = self._fs_path(path)
        fs.pipe_file(p, data)

    def lease_store(self, path: str) -> LeaseStore:
        return ObjectLeaseStore(open_store(path, self.storage_options, StoreConfig(concurrency=2)))


class ObjectLeaseStore:
    """Lease records under an object-store prefix. S3: exclusive create is a conditional PUT
    (``If-None-Match: *``); other fsspec stores check, then write (not atomic)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.location = store.url

    def create(self, name: str, data: bytes) -> bool:
        return self.store.put(name, data, if_absent=True)

    def write(self, name: str, data: bytes) -> None:
        self.store.put(name, data, if_absent=False)

    def read(self, name: str) -> bytes | None:
        data = self.store.get(name)
        return data if data is None or len(data) <= MAX_LEASE_RECORD_BYTES else None

    def list(self) -> list[str]:
        return self.store.list()

    def delete(self, names: Sequence[str]) -> None:
        self.store.delete(list(names))
