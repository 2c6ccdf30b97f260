"""NFSReader and committed-checkpoint discovery for shared file systems."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus.errors import (
    CheckpointFormatError,
)
from dcp_plus.format.record import RECORD_NAME, decode_record
from dcp_plus.readers.base import ExtentReader
from dcp_plus.storage.nfsio import join_target, open_nfs_store
from dcp_plus.storage.objectio import ObjectStore, StoreConfig
from dcp_plus.storage.retry import RetryPolicy
from dcp_plus.storage.urls import is_nfs_target

log = logging.getLogger(__name__)


class NFSReader(ExtentReader):
    """Parallel, checksum-verifying reader of checkpoints on a shared file system.

    Reads a mounted directory or an ``nfs://`` URL (see :class:`~dcp_plus.writers.NFSWriter`)
    with positional reads only (no mmap, no locks); ESTALE, EIO, timeouts and lost
    connections are retried up to ``max_retries`` times per batch, reopening the file.
    Supports resharding like :class:`~dcp_plus.readers.LocalReader`.

    Args:
        path: mounted checkpoint directory or ``nfs://host[:port]/export/dir`` URL.
        storage_options: for ``nfs://``: keyword arguments of ``nfs_rs.Client.connect``.
        verify: check every extent's checksum while loading (default on).
        concurrency: parallel 8 MiB reads.
        threads: batches (of up to 64 MiB of extents) prepared and delivered in parallel.
        max_retries, retry_base_delay, retry_max_delay: the retry bound and backoff.
        allow_pickle: also load stock DCP checkpoints of a mounted path (pickled record:
            only for checkpoints you trust).
        export: the export path for ``nfs://`` when it has more than one component.
    """

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                 *, verify: bool = True, concurrency: int = 4, threads: int = 4,
                 max_retries: int = 5, retry_base_delay: float = 0.2,
                 retry_max_delay: float = 10.0, allow_pickle: bool = False,
                 export: str | None = None) -> None:
        super().__init__(path, verify=verify, threads=threads, allow_pickle=allow_pickle)
        self.storage_options = dict(storage_options or {})
        self.config = StoreConfig(concurrency=concurrency,
                                  retry=RetryPolicy(max_retries, retry_base_delay,
                                                    retry_max_delay))
        self.export = export

    def _open_store(self) -> ObjectStore:
        return open_nfs_store(self.path, self.storage_options, self.config, export=self.export)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_nfs_target(checkpoint_id)

    def _stock_reader(self) -> StorageReader:
        if self.path.startswith("nfs://"):
            raise CheckpointFormatError(
                f"{self.path} was written by stock DCP; NFSReader reads those only from a "
                "mounted path, not over nfs://")
        return FileSystemReader(self.path)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A checkpoint whose commit record was read and parsed.

    Attributes:
        name: the directory's name under the root (e.g. ``"step_100"``).
        path: the directory (mounted path or ``nfs://`` URL), to pass to ``NFSReader``.
        save_id: the id of the save that committed it.
        tensors: number of entries in its state dict.
    """

    name: str
    path: str
    save_id: str | None
    tensors: int


def _natural_key(name: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p)
                 for p in re.split(r"(\d+)", name) if p)


def list_committed(root: str | os.PathLike, storage_options: dict[str, Any] | None = None, *,
                   export: str | None = None, max_retries: int = 5,
                   retry_base_delay: float = 0.2) -> list[CommittedCheckpoint]:
    """Committed checkpoints directly under ``root``, oldest first.

    A directory counts iff its ``.metadata`` can be read and parses as a dcp_plus record:
    the record itself is read (a file open, which revalidates NFS attribute caches), never a
    directory mtime or a cached ``stat``, so a checkpoint whose save failed or is still
    running is skipped, and one committed by another client is found. Order is by the
    numbers in the names (``step_9`` before ``step_10``), so name checkpoints by step.

    Args:
        root: mounted directory or ``nfs://host[:port]/export/dir`` URL holding checkpoints.
        storage_options, export: as for :class:`NFSReader`.
        max_retries, retry_base_delay: retry bound and backoff for each file operation.

    Raises:
        StorageError: listing or reading kept failing after ``max_retries`` retries.
    """
    config = StoreConfig(concurrency=1, retry=RetryPolicy(max_retries, retry_base_delay))
    base = os.fspath(root).rstrip("/")
    store = open_nfs_store(base, storage_options, config, export=export)
    found = []
    try:
        for name in sorted(store.list(), key=_natural_key):
            record_name = f"{name}/{RECORD_NAME}"
            data = store.get(record_name)
            if data is None:
                continue  # not a directory, or no commit record: not committed
            try:
                md = decode_record(data, store.location(record_name))
            except CheckpointFormatError as e:
                log.warning("skipping %s: %s", store.location(name), e)
                continue
            sid = md.storage_meta.save_id if md.storage_meta is not None else None
            found.append(CommittedCheckpoint(name, join_target(base, name), sid,
                                             len(md.state_dict_metadata)))
    finally:
        store.close()
    return found


def latest_committed(root: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                     **kwargs: Any) -> CommittedCheckpoint | None:
    """The last of :func:`list_committed`, or None when nothing under ``root`` is committed."""
    found = list_committed(root, storage_options, **kwargs)
    return found[-1] if found else None
