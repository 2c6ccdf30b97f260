"""LocalWriter: a DCP ``StorageWriter`` for a local (or mounted) directory."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcp_plus._worker import WriteJob
from dcp_plus.errors import CheckpointExistsError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.codecs import Codec
from dcp_plus.format.fileio import atomic_write, fsync_dir, pwrite_all
from dcp_plus.format.layout import DATA_SUFFIX
from dcp_plus.format.record import RECORD_NAME, Extent, encode_record
from dcp_plus.writers.base import CommittingWriter, is_url, new_save_id
from dcp_plus.writers.codec_choice import CodecChoice
from dcp_plus.writers.items import resolve_items
from dcp_plus.writers.layout import FilePlan, checksums_by_item, plan_files
from dcp_plus.writers.pool import (
    DEFAULT_NICE,
    check_pool_settings,
    shared_pool,
    shutdown_pool,
)

log = logging.getLogger(__name__)

_DATA_FILE = re.compile(r"^__\d+_\d+\.[0-9a-f]+" + re.escape(DATA_SUFFIX) + "$")


class LocalWriter(CommittingWriter):
    """Checksummed, durable, atomically committed checkpoints in a local directory.

    Tensors that live in an :class:`~dcp_plus.stagers.ArenaStager` slab are written by the
    shared worker-process pool from ``(slab, offset, length)`` descriptors, without copying;
    other data is written by ``threads`` threads of this process straight from tensor memory.

    Args:
        path: checkpoint directory (created if missing).
        overwrite: allow replacing a committed checkpoint; the old one stays loadable until
            the new commit record is in place, then its data files are removed.
        workers: size of the shared writer-process pool.
        threads: parallel files for data outside slabs.
        fsync: fsync data files and directories (turn off only for throwaway checkpoints).
        direct_io: write stager-slab data with ``O_DIRECT`` (no page-cache copy: less CPU
            taken from training and faster durable saves); ignored where the file system
            refuses it (tmpfs), and only slab-backed data is written this way.
        worker_nice: CPU niceness of the worker processes (0-19, default 10), so that a
            persist running beside training yields the cores to the training step.
        codec, codecs: how tensors are stored (default ``"identity"``; ``"zstd"``,
            ``"zstd+shuffle"`` or a ``ZstdCodec``), and per-name overrides
            ``{fnmatch pattern: codec}``. Encoded tensors are written by this process's
            threads rather than from the stager's slabs.
    """

    _transient = ("_io",)

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, workers: int = 2,
                 threads: int = 2, fsync: bool = True, direct_io: bool = True,
                 worker_nice: int = DEFAULT_NICE, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.workers = workers
        self.threads = threads
        self.fsync = fsync
        self.direct_io = direct_io
        check_pool_settings("LocalWriter", workers, worker_nice)
        self.worker_nice = worker_nice
        self.codecs = CodecChoice(codec, codecs)
        self.save_id = new_save_id()
        self.rank = 0
        self.is_coordinator = True
        self._io: ThreadPoolExecutor | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.save_id = new_save_id()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return not is_url(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._refuse_without_collectives(kwargs)
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.save_id = new_save_id()
        os.makedirs(self.path, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self.path, RECORD_NAME)):
            raise CheckpointExistsError(self._exists_message())

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = self._plan_info(plan)
        rank, save_id = info.rank, info.save_id
        items = resolve_items(plan, planner)
        raw_lengths = {id(r): len(r.data) for r in items}
        codec_names = {id(r): self.codecs.encode(r) for r in items}
        slab_files, local_files = plan_files(items, rank, save_id, self.threads,
                                             slab_parts=self.workers)
        for fp in slab_files + local_files:
            fd = os.open(os.path.join(self.path, fp.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644)
            os.close(fd)
        sums: dict[int, str] = {}
        pending = []
        if local_files:
            if self._io is None:
                self._io = ThreadPoolExecutor(self.threads, thread_name_prefix="dcpp-write")
            pending = [self._io.submit(self._write_local, fp) for fp in local_files]
        if slab_files:
            jobs = [WriteJob(os.path.abspath(os.path.join(self.path, fp.name)),
                             fp.slab_ranges(), self.fsync, self.direct_io)
                    for fp in slab_files]  # one job per file: never two writers to a file
            job_sums = shared_pool(self.workers, self.worker_nice).run(jobs)
            sums.update(checksums_by_item(slab_files, job_sums))
        for f in pending:
            sums.update(f.result())
        extents = [(r.item.index, Extent(fp.name, off, len(r.data), raw_lengths[id(r)],
                                         codec_names[id(r)], sums[id(r)]))
                   for fp in slab_files + local_files for r, off in fp.placed]
        results = self._results(info, extents)
        if self.fsync:
            fsync_dir(self.path)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_local(self, fp: FilePlan) -> dict[int, str]:
        sums = {}
        fd = os.open(os.path.join(self.path, fp.name), os.O_WRONLY)
        try:
            for r, off in fp.placed:
                sums[id(r)] = checksum_bytes(r.data)
                pwrite_all(fd, r.data, off)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return sums

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        extents, tables = self._collect(metadata, results)
        record = encode_record(metadata, extents)
        atomic_write(os.path.join(self.path, RECORD_NAME), record, self.save_id)
        self._delete_tables(tables)
        if self.overwrite:
            self._remove_unreferenced({e.file for e in extents.values()})

    def _put_table(self, name: str, data: bytes) -> None:
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pwrite_all(fd, memoryview(data), 0)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _get_table(self, name: str) -> bytes:
        with open(os.path.join(self.path, name), "rb") as f:
            return f.read()

    def _delete_tables(self, names: Sequence[str]) -> None:
        for name in names:
            os.unlink(os.path.join(self.path, name))

    def _remove_unreferenced(self, keep: set[str]) -> None:
        for name in os.listdir(self.path):
            if _DATA_FILE.match(name) and name not in keep:
                os.unlink(os.path.join(self.path, name))
                log.info("removed %s, replaced by the new commit", name)

    def close(self) -> None:
        """Join this writer's threads and stop the shared worker pool (restarts on next use)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        shutdown_pool()
