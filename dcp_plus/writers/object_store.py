"""ObjectStoreWriter: a DCP ``StorageWriter`` for any fsspec URL, tuned for S3."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from dcp_plus.errors import InvalidOptionError
from dcp_plus.format.codecs import Codec
from dcp_plus.format.key_prefix import (
    MARKER_NAME,
    KeyPrefixes,
    decode_marker,
    encode_marker,
    insert_prefix,
)
from dcp_plus.storage.objectio import ObjectStore, StoreConfig, open_store
from dcp_plus.storage.placement import Placed
from dcp_plus.storage.rate import Bucket
from dcp_plus.storage.retry import RetryPolicy
from dcp_plus.storage.urls import names_location, prefixable
from dcp_plus.writers.base import CommittingWriter, Fence
from dcp_plus.writers.chunk_encode import DEFAULT_PART_BYTES
from dcp_plus.writers.layout import FilePlan
from dcp_plus.writers.pool import DEFAULT_NICE
from dcp_plus.writers.worker import Job, UploadJob


class ObjectStoreWriter(CommittingWriter):
    """Checksummed checkpoints in an object store (or any fsspec filesystem).

    Each rank uploads its data as write-once objects ``__{rank}_{k}.{save_id}.dcpp`` (S3:
    parallel multipart uploads of ``part_size`` parts, ``concurrency`` requests in flight;
    other filesystems: streamed writes). The coordinator then writes the commit record
    ``.metadata`` with a single PUT, last; a checkpoint exists iff that object exists.

    Args:
        url: checkpoint prefix, e.g. ``"s3://bucket/run/step_100"``, ``"memory://ckpt"``.
        storage_options: passed to fsspec untouched (s3fs: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, ``config_kwargs``...).
        overwrite: allow replacing a committed checkpoint; the old one stays loadable until
            the new record is in place, then the data objects it referenced are deleted.
        part_size: multipart part size in bytes (S3 needs >= 5 MiB).
        concurrency: requests in flight per rank; bounds memory to ``concurrency * part_size``.
        max_retries: retries per request on throttling, 5xx and connection failures.
        retry_base_delay: first backoff (seconds); doubles per retry, fully jittered...
        retry_max_delay: ...up to this cap.
        codec: how tensors are stored: ``"identity"`` (default), ``"zstd"``,
            ``"zstd+shuffle"``, or a codec instance such as ``ZstdCodec(level=9, threads=8)``.
        codecs: per tensor-name overrides, ``{fnmatch pattern: codec}``; the first matching
            pattern wins, e.g. ``{"*.weight": "zstd+shuffle", "optim.*": "identity"}``.
            Non-tensor values are always stored as they are.
        workers, worker_nice: the shared writer-process pool (as for ``LocalWriter``). On S3,
            data in :class:`~dcp_plus.stagers.ArenaStager` slabs is checksummed and uploaded
            by these processes from ``(slab, offset, length)`` descriptors, one object per
            slab, so the trainer's threads only do bookkeeping; other data (and every other
            filesystem, ``memory://`` being per process) is uploaded by this process.
        max_bytes_per_s, stagger: as for :class:`~dcp_plus.writers.LocalWriter`; on S3 a
            request waits for its whole body's share, so the cap's grain is ``part_size``
            (a smaller ``part_size`` shapes finer; other filesystems are paced in 4 MiB).
        base, incremental, part_bytes: incremental checkpoints, as for
            :class:`~dcp_plus.writers.LocalWriter` (``base``: a committed checkpoint beside
            this one).
        fence, allow_pickle: as for :class:`~dcp_plus.writers.LocalWriter`.
        key_prefixes: spread the ranks' objects over key prefixes of the bucket, as S3
            throttles per prefix: :class:`~dcp_plus.HexPrefixes` ``(depth)``,
            :class:`~dcp_plus.BinaryPrefixes` ``(depth)`` or
            :class:`~dcp_plus.RoundRobinPrefixes` ``([...])``. Rank ``r``'s data objects go
            to ``<bucket>/<prefix(r)>/<checkpoint key>/``; the record (which names each
            object's prefix) stays at the checkpoint key. None (default): all objects there.

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``url`` and ``overwrite`` is off.
        StorageError: a request kept failing after ``max_retries`` retries.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 overwrite: bool = False, part_size: int = 32 << 20, concurrency: int = 8,
                 max_retries: int = 5, retry_base_delay: float = 0.2,
                 retry_max_delay: float = 10.0, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None, workers: int = 2,
                 worker_nice: int = DEFAULT_NICE, max_bytes_per_s: float | None = None,
                 stagger: float = 0.0, fence: Fence | None = None,
                 allow_pickle: bool = False, key_prefixes: KeyPrefixes | None = None,
                 base: str | os.PathLike | None = None, incremental: bool = False,
                 part_bytes: int = DEFAULT_PART_BYTES) -> None:
        super().__init__(url, overwrite=overwrite, codec=codec, codecs=codecs, fence=fence,
                         allow_pickle=allow_pickle, workers=workers, worker_nice=worker_nice,
                         max_bytes_per_s=max_bytes_per_s, stagger=stagger,
                         base=base, incremental=incremental, part_bytes=part_bytes)
        if key_prefixes is not None and not isinstance(key_prefixes, KeyPrefixes):
            raise InvalidOptionError(f"ObjectStoreWriter key_prefixes: expected HexPrefixes, "
                                     f"BinaryPrefixes, RoundRobinPrefixes or None, got "
                                     f"{key_prefixes!r}")
        self.key_prefixes = key_prefixes
        if key_prefixes is not None and self.increments is not None:
            raise InvalidOptionError(f"{url}: ObjectStoreWriter cannot combine key_prefixes "
                                     "with incremental checkpoints (base=, incremental=) yet")
        self._check_prefixable()
        self.storage_options = dict(storage_options or {})
        self.config = StoreConfig(part_size=part_size, concurrency=concurrency,
                                  retry=RetryPolicy(max_retries, retry_base_delay,
                                                    retry_max_delay))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str) and names_location(checkpoint_id)

    def _check_prefixable(self) -> None:
        if self.key_prefixes is None:
            return
        try:
            insert_prefix(self.path, self.key_prefixes.prefix(0))
            if not prefixable(self.path):
                raise ValueError(f"{self.path}: key prefixes are for object stores (s3://, "
                                 "gs://, az://, memory://...)")
        except ValueError as e:
            raise InvalidOptionError(str(e)) from None

    def _open_store(self) -> ObjectStore:
        self._check_prefixable()  # reset() may have moved the writer
        return open_store(self.path, self.storage_options, self.config)

    def _rank_prefix(self, rank: int) -> str | None:
        return None if self.key_prefixes is None else self.key_prefixes.prefix(rank)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if is_coordinator and self.key_prefixes is not None:
            # before any rank writes data (DCP plans first): clean-up of a save that never
            # commits finds its prefixes here (those of earlier saves under this key kept)
            store = self._store
            old = store.get(MARKER_NAME)
            try:
                known = [] if old is None else decode_marker(old, store.location(MARKER_NAME))
            except ValueError:
                known = []
            store.put(MARKER_NAME, encode_marker(dict.fromkeys([*known, self.key_prefixes])),
                      if_absent=False)

    def _worker_jobs(self, files: list[FilePlan], pace: Bucket | None) -> list[Job]:
        # the workers upload side by side: together they keep `concurrency` requests in flight
        side_by_side = min(self.workers, len(files))
        config = dataclasses.replace(
            self.config, concurrency=max(1, self.config.concurrency // side_by_side))
        rate = None if pace is None else pace.limit
        store = self._store
        where = store.folder_url if isinstance(store, Placed) else lambda _: self.path
        return [UploadJob(where(fp.name), self.storage_options, config, fp.name, fp.size,
                          fp.slab_ranges(), rate)
                for fp in files]
