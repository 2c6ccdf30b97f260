"""ObjectStoreWriter: a DCP ``StorageWriter`` for any fsspec URL, tuned for S3."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcp_plus.errors import CheckpointExistsError, CheckpointFormatError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.codecs import Codec
from dcp_plus.format.record import RECORD_NAME
from dcp_plus.storage.objectio import ObjectStore, StoreConfig, open_store
from dcp_plus.storage.retry import RetryPolicy
from dcp_plus.writers.base import CommittingWriter, Fence, is_url, new_save_id
from dcp_plus.writers.codec_choice import CodecChoice
from dcp_plus.writers.items import resolve_items
from dcp_plus.writers.layout import FilePlan, checksums_by_item, plan_files
from dcp_plus.writers.pool import DEFAULT_NICE, check_pool_settings, shared_pool
from dcp_plus.writers.worker import UploadJob


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
        fence, allow_pickle: as for :class:`~dcp_plus.writers.LocalWriter`.

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``url`` and ``overwrite`` is off.
        StorageError: a request kept failing after ``max_retries`` retries.
    """

    _transient = ("_store_obj",)  # the store reconnects in DCP's PROCESS-mode daemon

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 overwrite: bool = False, part_size: int = 32 << 20, concurrency: int = 8,
                 max_retries: int = 5, retry_base_delay: float = 0.2,
                 retry_max_delay: float = 10.0, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None, workers: int = 2,
                 worker_nice: int = DEFAULT_NICE, fence: Fence | None = None,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.fence = fence
        self.allow_pickle = allow_pickle
        check_pool_settings("ObjectStoreWriter", workers, worker_nice)
        self.workers = workers
        self.worker_nice = worker_nice
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

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._set_up(is_coordinator, kwargs)
        if is_coordinator and not self.overwrite and self._committed():
            raise CheckpointExistsError(self._exists_message())

    def _committed(self) -> bool:
        return self._store.sizes([RECORD_NAME])[RECORD_NAME] is not None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = self._plan_info(plan)
        rank, save_id = info.rank, self.save_id
        items = resolve_items(plan, planner, self.allow_pickle)
        raw_lengths = {id(r): len(r.data) for r in items}
        codec_names = {id(r): self.codecs.encode(r) for r in items}
        slab_files, other_files = plan_files(items, rank, save_id, bins=1)
        files: list[FilePlan] = slab_files + other_files
        in_workers = slab_files if self._store.uploads_from_any_process else []
        in_process = other_files if in_workers else files
        sums: dict[int, str] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="dcpp-upload") as feeder:
            pending = feeder.submit(self._upload_in_workers, in_workers) if in_workers else None
            objects = []
            for fp in in_process:
                sums.update((id(r), checksum_bytes(r.data)) for r, _ in fp.placed)
                objects.append((fp.name, [(off, r.data) for r, off in fp.placed if len(r.data)],
                                fp.size))
            self._store.upload(objects)
            if pending is not None:
                sums.update(pending.result())
        extents = self._extents(files, raw_lengths, codec_names, sums)
        results = self._results(info, extents)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _upload_in_workers(self, files: list[FilePlan]) -> dict[int, str]:
        """Each slab-backed object uploaded by a worker process; the extents' checksums."""
        # the workers upload side by side: together they keep `concurrency` requests in flight
        side_by_side = min(self.workers, len(files))
        config = dataclasses.replace(
            self.config, concurrency=max(1, self.config.concurrency // side_by_side))
        jobs = [UploadJob(self.url, self.storage_options, config, fp.name, fp.size,
                          fp.slab_ranges())
                for fp in files]
        return checksums_by_item(files, shared_pool(self.workers, self.worker_nice).run(jobs))

    def _committed_record(self) -> bytes | None:
        return self._store.get(RECORD_NAME)

    def _commit(self, record: bytes) -> None:
        if not self._store.put(RECORD_NAME, record, if_absent=not self.overwrite):
            raise CheckpointExistsError(self._exists_message() + " (it was committed while "
                                        "this save was running)")

    def _put_table(self, name: str, data: bytes) -> None:
        self._store.put(name, data, if_absent=False)

    def _get_table(self, name: str) -> bytes:
        data = self._store.get(name)
        if data is None:
            raise CheckpointFormatError(f"{self._store.location(name)}: extent table missing")
        return data

    def _delete_tables(self, names: Sequence[str]) -> None:
        self._store.delete(list(names))

    def _delete_data(self, names: Sequence[str]) -> None:
        self._store.delete(list(names))

    def close(self) -> None:
        """Release this writer's connections and threads (reopened on next use)."""
        if self._store_obj is not None:
            self._store_obj.close()
            self._store_obj = None
