"""ObjectStoreWriter: a DCP ``StorageWriter`` for any fsspec URL, tuned for S3."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_plus.errors import CheckpointExistsError, CheckpointFormatError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.codecs import Codec
from dcp_plus.format.layout import DATA_SUFFIX
from dcp_plus.format.objectio import ObjectStore, StoreConfig, open_store
from dcp_plus.format.record import RECORD_NAME, Extent, encode_record
from dcp_plus.format.retry import RetryPolicy
from dcp_plus.writers.codec_choice import CodecChoice
from dcp_plus.writers.items import resolve_items
from dcp_plus.writers.layout import FilePlan, plan_files
from dcp_plus.writers.local import _RankInfo, is_url, new_save_id

log = logging.getLogger(__name__)

_DATA_OBJECT = re.compile(r"^__\d+_\d+\.[0-9a-f]+" + re.escape(DATA_SUFFIX) + "$")


class ObjectStoreWriter(StorageWriter):
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
            the new record is in place, then its data objects are deleted.
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

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``url`` and ``overwrite`` is off.
        StorageError: a request kept failing after ``max_retries`` retries.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 overwrite: bool = False, part_size: int = 32 << 20, concurrency: int = 8,
                 max_retries: int = 5, retry_base_delay: float = 0.2,
                 retry_max_delay: float = 10.0, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None) -> None:
        super().__init__()
        self.codecs = CodecChoice(codec, codecs)
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite
        self.config = StoreConfig(part_size=part_size, concurrency=concurrency,
                                  retry=RetryPolicy(max_retries, retry_base_delay,
                                                    retry_max_delay))
        self.save_id = new_save_id()
        self.rank = 0
        self.is_coordinator = True
        self._store_obj: ObjectStore | None = None

    # DCP pickles writers into its PROCESS-mode daemon: the store reconnects there.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store_obj"] = None
        return state

    @property
    def _store(self) -> ObjectStore:
        if self._store_obj is None:
            self._store_obj = open_store(self.url, self.storage_options, self.config)
        return self._store_obj

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id).rstrip("/")
            self.close()
        self.save_id = new_save_id()

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_url(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # every rank would run finish() and commit a record holding only its own items
            raise CheckpointFormatError(
                f"{self.url}: ObjectStoreWriter needs use_collectives=True: the coordinator "
                "commits one record of every rank's data. For a single-process save use "
                "no_dist=True")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.save_id = new_save_id()
        if is_coordinator and not self.overwrite and self._committed():
            raise CheckpointExistsError(self._exists_message())

    def _committed(self) -> bool:
        return self._store.sizes([RECORD_NAME])[RECORD_NAME] is not None

    def _exists_message(self) -> str:
        return (f"{self.url} already holds a committed checkpoint; pass overwrite=True to "
                "replace it (the old one stays loadable until the new one commits) or save "
                "to a new prefix")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = new_save_id()
        self.save_id = save_id  # the coordinator records the id its data objects carry
        return [dataclasses.replace(p, storage_data=_RankInfo(i, save_id))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        rank, save_id = (info.rank, info.save_id) if isinstance(info, _RankInfo) else (
            self.rank, self.save_id)
        items = resolve_items(plan, planner)
        raw_lengths = {id(r): len(r.data) for r in items}
        codec_names = {id(r): self.codecs.encode(r) for r in items}
        slab_files, other_files = plan_files(items, rank, save_id, bins=1)
        files: list[FilePlan] = slab_files + other_files
        sums = {id(r): checksum_bytes(r.data) for r in items}  # of the stored bytes
        objects = []
        for fp in files:
            segments = [(off, r.data) for r, off in fp.placed if len(r.data)]
            total = max((off + len(r.data) for r, off in fp.placed), default=0)
            objects.append((fp.name, segments, total))
        self._store.upload(objects)
        results = []
        for fp in files:
            for r, off in fp.placed:
                ext = Extent(fp.name, off, len(r.data), raw_lengths[id(r)], codec_names[id(r)],
                             sums[id(r)])
                results.append(WriteResult(index=r.item.index, size_in_bytes=len(r.data),
                                           storage_data=ext))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        extents: dict[MetadataIndex, Extent] = {}
        for rank_results in results:
            for wr in rank_results:
                extents[wr.index] = wr.storage_data
        metadata.storage_data = extents
        metadata.storage_meta = self.storage_meta()
        metadata.version = CURRENT_DCP_VERSION
        record = encode_record(metadata, extents)
        if not self._store.put(RECORD_NAME, record, if_absent=not self.overwrite):
            raise CheckpointExistsError(self._exists_message() + " (it was committed while "
                                        "this save was running)")
        if self.overwrite:
            self._remove_unreferenced({e.file for e in extents.values()})

    def _remove_unreferenced(self, keep: set[str]) -> None:
        stale = [n for n in self._store.list() if _DATA_OBJECT.match(n) and n not in keep]
        self._store.delete(stale)
        for name in stale:
            log.info("removed %s, replaced by the new commit", self._store.location(name))

    def close(self) -> None:
        """Release this writer's connections and threads (reopened on next use)."""
        if self._store_obj is not None:
            self._store_obj.close()
            self._store_obj = None
