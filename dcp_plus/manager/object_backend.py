"""The manager's backend for object stores and other fsspec URLs (``s3://``, ``gs://``,
``memory://`` ...): :class:`~dcp_plus.ObjectStoreWriter` / ``ObjectStoreReader``."""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from dcp_plus.errors import DcpPlusError, InvalidOptionError
from dcp_plus.format.key_prefix import (
    MARKER_NAME,
    RoundRobinPrefixes,
    bucket_path,
    decode_marker,
    encode_marker,
    insert_prefix,
)
from dcp_plus.format.parts import spans
from dcp_plus.format.record import RECORD_NAME, decode_record
from dcp_plus.manager.lease import MAX_LEASE_RECORD_BYTES, LeaseStore
from dcp_plus.manager.options import ObjectStoreReaderOptions, ObjectStoreWriterOptions
from dcp_plus.storage.objectio import ObjectStore, StoreConfig, open_store
from dcp_plus.storage.urls import prefixable

log = logging.getLogger(__name__)
PROBED_PREFIXES = 256
"""Up to this many candidate key prefixes are each removed blindly; more are first
narrowed down to those that exist (one listing of the bucket's top level)."""


class ObjectStoreBackend:
    """Checkpoints under a URL prefix; ``storage_options`` go to fsspec untouched.

    There are no directories or renames: a checkpoint exists iff its ``.metadata`` object
    does, and the ``latest`` pointer is one PUT (atomic on object stores). Removing a
    checkpoint also removes its objects under key prefixes (``key_prefixes``): those its
    record names, and those of every strategy its saves used (the ``.key_prefixes`` marker
    a save writes before any data), committed or not.
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

        if options.get("key_prefixes") is not None and "/" not in path[
                len(bucket_path(path)):].strip("/"):
            raise InvalidOptionError(f"{path}: with key_prefixes the root must lie below the "
                                     "bucket (e.g. s3://bucket/run), so that the prefixes do "
                                     "not sit among its step folders")
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
            sizes: dict[tuple[str | None, str], int | None] = {}
            for index, ext in md.storage_data.items():
                for where, file, end in spans(ext):
                    if ext.prefix is not None and not prefixable(path):
                        raise DcpPlusError(f"{path}: its record names key prefixes, which "
                                           "this store does not take")
                    if (where, file) not in sizes:
                        folder = p if where is None else f"{p.rpartition('/')[0]}/{where}"
                        folder = folder if ext.prefix is None else insert_prefix(folder,
                                                                                 ext.prefix)
                        try:
                            sizes[where, file] = int(fs.size(f"{folder}/{file}"))
                        except FileNotFoundError:
                            sizes[where, file] = None
                    size = sizes[where, file]
                    if size is None or end > size:
                        shown = file if where is None else f"../{where}/{file}"
                        problems.append(f"{self.join(path, shown)}: extent of {index.fqn!r} "
                                        f"missing or past the end ({size} bytes)")
            return problems
        except (OSError, ValueError, DcpPlusError) as e:
            return [f"{path}: {e}"]

    def uncommit(self, path: str) -> None:
        self._keep_record_prefixes(path)  # remove_tree, after this, finds them in the marker
        fs, p = self._fs_path(self.join(path, RECORD_NAME))
        try:
            fs.rm_file(p)
        except FileNotFoundError:
            pass

    def _keep_record_prefixes(self, path: str) -> None:
        """Add the key prefixes the record names to the ``.key_prefixes`` marker."""
        record = self.read(self.join(path, RECORD_NAME))
        if record is None or record[:1] != b"{":
            return
        try:
            md = decode_record(record, self.join(path, RECORD_NAME))
        except DcpPlusError:
            return
        prefixes = sorted({e.prefix for e in md.storage_data.values() if e.prefix})
        if not prefixes:
            return
        marker = self.read(self.join(path, MARKER_NAME))
        try:
            strategies = [] if marker is None else decode_marker(marker, path)
        except ValueError:
            strategies = []
        strategies.append(RoundRobinPrefixes(prefixes))
        self.write_atomic(self.join(path, MARKER_NAME), encode_marker(strategies))

    def remove_tree(self, path: str) -> None:
        fs, p = self._fs_path(path)
        prefixes = self._key_prefixes(fs, p, path) if prefixable(path) else []
        for prefix in prefixes:  # before the marker that names them
            target = insert_prefix(p, prefix)
            fs.invalidate_cache(target)
            try:
                fs.rm(target, recursive=True)
            except FileNotFoundError:
                pass
        try:
            fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass

    def _key_prefixes(self, fs: Any, p: str, path: str) -> list[str]:
        """The key prefixes objects of checkpoint ``path`` (``p`` on ``fs``) may lie under:
        the record's, and the marker's strategies' (those that exist, if many)."""
        found: set[str] = set()
        record = self.read(self.join(path, RECORD_NAME))
        if record is not None and record[:1] == b"{":
            try:
                md = decode_record(record, self.join(path, RECORD_NAME))
                found.update(e.prefix for e in md.storage_data.values() if e.prefix)
            except DcpPlusError as e:
                log.warning("%s: the prefixes of its unreadable record are not removed (%s)",
                            path, e)
        marker = self.read(self.join(path, MARKER_NAME))
        if marker is None:
            return sorted(found)
        try:
            strategies = decode_marker(marker, self.join(path, MARKER_NAME))
        except ValueError as e:
            log.warning("%s: key prefixes not removed: %s", path, e)
            return sorted(found)
        candidates = {prefix for s in strategies for prefix in s.all()}
        if len(candidates) > PROBED_PREFIXES:
            bucket = bucket_path(p)
            fs.invalidate_cache(bucket)
            candidates &= {posixpath.basename(e.rstrip("/")) for e in fs.ls(bucket, detail=False)}
        return sorted(found | candidates)

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
