"""LocalWriter: a DCP ``StorageWriter`` for a local (or mounted) directory."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcp_plus.errors import CheckpointExistsError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.codecs import Codec
from dcp_plus.format.record import MAX_RECORD_BYTES, RECORD_NAME
from dcp_plus.storage.fileio import (
    atomic_create,
    atomic_write,
    fsync_dir,
    pwrite_all,
    read_regular,
)
from dcp_plus.writers.base import CommittingWriter, Fence, is_url, new_save_id
from dcp_plus.writers.codec_choice import CodecChoice
from dcp_plus.writers.items import resolve_items
from dcp_plus.writers.layout import FilePlan, checksums_by_item, plan_files
from dcp_plus.writers.pool import (
    DEFAULT_NICE,
    check_pool_settings,
    shared_pool,
    shutdown_pool,
)
from dcp_plus.writers.worker import WriteJob


class LocalWriter(CommittingWriter):
    """Checksummed, durable, atomically committed checkpoints in a local directory.

    Tensors that live in an :class:`~dcp_plus.stagers.ArenaStager` slab are written by the
    shared worker-process pool from ``(slab, offset, length)`` descriptors, without copying;
    other data is written by ``threads`` threads of this process straight from tensor memory.

    Args:
        path: checkpoint directory (created if missing).
        overwrite: allow replacing a committed checkpoint; the old one stays loadable until
            the new commit record is in place, then the data files it referenced are removed
            (no other file: files of another save, running or crashed, are left in place).
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
        fence: called by the coordinator before the save writes anything and again just
            before it commits; raising aborts the save on every rank. ``CheckpointManager``
            passes its root lease's check, so a writer that lost its lease never commits.
        allow_pickle: also store non-tensor values that only load by full unpickling
            (refused by default; ``io.BytesIO`` values are always stored as raw bytes).
            Loading them needs ``allow_pickle=True`` on the reader and a planner that
            unpickles (``DefaultLoadPlanner``): only for checkpoints you will trust.
    """

    _transient = ("_io",)

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, workers: int = 2,
                 threads: int = 2, fsync: bool = True, direct_io: bool = True,
                 worker_nice: int = DEFAULT_NICE, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None,
                 fence: Fence | None = None,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.fence = fence
        self.allow_pickle = allow_pickle
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
        self._set_up(is_coordinator, kwargs)
        os.makedirs(self.path, exist_ok=True)
        if not self.overwrite and os.path.exists(os.path.join(self.path, RECORD_NAME)):
            raise CheckpointExistsError(self._exists_message())

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = self._plan_info(plan)
        rank, save_id = info.rank, self.save_id
        items = resolve_items(plan, planner, self.allow_pickle)
        raw_lengths = {id(r): len(r.data) for r in items}
        codec_names = {id(r): self.codecs.encode(r) for r in items}
        slab_files, local_files = plan_files(items, rank, save_id, self.threads,
                                             slab_parts=self.workers)
        created: list[str] = []
        try:
            for fp in slab_files + local_files:
                fd = os.open(os.path.join(self.path, fp.name),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.close(fd)
                created.append(fp.name)
            sums = self._write_files(slab_files, local_files)
            extents = self._extents(slab_files + local_files, raw_lengths, codec_names, sums)
        except BaseException:
            self._delete_data(created)  # this save's own files: no other save is touched
            raise
        results = self._results(info, extents)
        if self.fsync:
            fsync_dir(self.path)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(self, slab_files: list[FilePlan],
                     local_files: list[FilePlan]) -> dict[int, str]:
        """Write the planned files (slab-backed ones by the worker pool, the others by this
        process's threads); the content checksums by ``id(item)``."""
        sums: dict[int, str] = {}
        pending = []
        if local_files:
            if self._io is None:
                self._io = ThreadPoolExecutor(self.threads, thread_name_prefix="dcpp-write")
            pending = [self._io.submit(self._write_local, fp) for fp in local_files]
        try:
            if slab_files:
                jobs = [WriteJob(os.path.abspath(os.path.join(self.path, fp.name)),
                                 fp.slab_ranges(), self.fsync, self.direct_io)
                        for fp in slab_files]  # one job per file: never two writers to a file
                job_sums = shared_pool(self.workers, self.worker_nice).run(jobs)
                sums.update(checksums_by_item(slab_files, job_sums))
        finally:
            wait_futures(pending)  # no thread may still write when this returns or raises
        for f in pending:
            sums.update(f.result())
        return sums

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

    def _committed_record(self) -> bytes | None:
        try:
            return read_regular(self.path, RECORD_NAME, MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None

    def _commit(self, record: bytes) -> None:
        path = os.path.join(self.path, RECORD_NAME)
        if self.overwrite:
            atomic_write(path, record, self.save_id)
        elif not atomic_create(path, record, self.save_id):
            raise CheckpointExistsError(self._exists_message() + " (it was committed while "
                                        "this save was running)")

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

    def _delete_data(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Join this writer's threads and stop the shared worker pool (restarts on next use)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        shutdown_pool()
