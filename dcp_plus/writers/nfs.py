"""NFSWriter: a DCP ``StorageWriter`` for shared file systems (a mount, or ``nfs://``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dcp_plus.format.codecs import Codec
from dcp_plus.storage.nfsio import open_nfs_store
from dcp_plus.storage.objectio import ObjectStore, StoreConfig
from dcp_plus.storage.retry import RetryPolicy
from dcp_plus.storage.urls import is_nfs_target
from dcp_plus.writers.base import CommittingWriter, Fence
from dcp_plus.writers.chunk_encode import DEFAULT_PART_BYTES


class NFSWriter(CommittingWriter):
    """Checksummed checkpoints on a shared file system, safe under NFS semantics.

    ``path`` is either a directory of a mounted shared file system (NFS, Lustre, GPFS...) or
    an ``nfs://host[:port]/export/dir?version=4.1`` URL reached through the user-space client
    ``nfs-rs`` (``pip install 'dcp-plus[nfs]'``; no kernel mount needed). Each rank writes its
    own data file ``__{rank}_0.{save_id}.dcpp`` with positional writes (no O_DIRECT, mmap or
    locks) and fsyncs it and the directory; the coordinator then commits ``.metadata`` by
    writing a temporary file and linking it into place (``overwrite=True``: renaming over the
    old record). A checkpoint exists iff ``.metadata`` exists. ESTALE, EIO, timeouts and lost
    connections are retried a bounded number of times (a data file is rewritten whole, since
    a failed fsync may have dropped its dirty pages), then fail with ``StorageError``.

    Args:
        path: mounted directory or ``nfs://`` URL.
        storage_options: for ``nfs://``: keyword arguments of ``nfs_rs.Client.connect``
            (``uid``, ``gid``, ``connect_timeout``, ``operation_timeout``...), untouched.
        overwrite: allow replacing a committed checkpoint; the old one stays loadable until
            the new record is in place, then the data files it referenced are removed.
        fsync: fsync data files and directories of a mounted path (``nfs://`` writes are
            always durable when they return).
        concurrency: parallel 8 MiB writes per rank.
        max_retries, retry_base_delay, retry_max_delay: the retry bound and backoff.
        codec, codecs: as for :class:`~dcp_plus.writers.LocalWriter`.
        export: the export path for ``nfs://`` when it has more than one component
            (default: the URL's first path component).
        max_bytes_per_s, stagger: as for :class:`~dcp_plus.writers.LocalWriter` (paced in
            4 MiB writes).
        base, incremental, part_bytes: incremental checkpoints, as for
            :class:`~dcp_plus.writers.LocalWriter` (``base``: a committed checkpoint beside
            this one).
        fence, allow_pickle: as for :class:`~dcp_plus.writers.LocalWriter`.

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``path`` and ``overwrite`` is off.
        StorageError: an operation kept failing after ``max_retries`` retries.
    """

    def __init__(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                 *, overwrite: bool = False, fsync: bool = True, concurrency: int = 4,
                 max_retries: int = 5, retry_base_delay: float = 0.2,
                 retry_max_delay: float = 10.0, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None,
                 export: str | None = None, max_bytes_per_s: float | None = None,
                 stagger: float = 0.0, fence: Fence | None = None,
                 allow_pickle: bool = False,
                 base: str | os.PathLike | None = None, incremental: bool = False,
                 part_bytes: int = DEFAULT_PART_BYTES) -> None:
        super().__init__(path, overwrite=overwrite, codec=codec, codecs=codecs, fence=fence,
                         allow_pickle=allow_pickle, max_bytes_per_s=max_bytes_per_s,
                         stagger=stagger,
                         base=base, incremental=incremental, part_bytes=part_bytes)
        self.storage_options = dict(storage_options or {})
        self.config = StoreConfig(concurrency=concurrency,
                                  retry=RetryPolicy(max_retries, retry_base_delay,
                                                    retry_max_delay))
        self.fsync = fsync
        self.export = export

    def _open_store(self) -> ObjectStore:
        return open_nfs_store(self.path, self.storage_options, self.config,
                              export=self.export, fsync=self.fsync)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_nfs_target(checkpoint_id)
