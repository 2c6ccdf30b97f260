"""The manager's backend for object stores and other fsspec URLs (``s3://``, ``gs://``,
``memory://`` ...): :class:`~dcp_plus.ObjectStoreWriter` / ``ObjectStoreReader``."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_plus.errors import DcpPlusError
from dcp_plus.format.record import RECORD_NAME, decode_record


class ObjectStoreBackend:
    """Checkpoints under a URL prefix; ``storage_options`` go to fsspec untouched.

    There are no directories or renames: a checkpoint exists iff its ``.metadata`` object
    does, and the ``latest`` pointer is one PUT (atomic on object stores).
    """

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
