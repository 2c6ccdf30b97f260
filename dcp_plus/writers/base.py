"""The one committing writer: every dcp_plus ``StorageWriter`` is this over a store.

A store (``LocalFileStore``, an NFS store, an fsspec/S3 store) holds the files of one
checkpoint; this class plans the data files, writes them (slab-backed ones by the shared
worker-process pool where the store lets another process write, the rest in this process),
exchanges each rank's extents in O(1) bytes per rank, and commits the record last.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_plus._gc import gc_paused
from dcp_plus.errors import CheckpointExistsError, CheckpointFormatError, DcpPlusError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.codecs import Codec
from dcp_plus.format.extent import Extent
from dcp_plus.format.extent_set import extent_files
from dcp_plus.format.layout import extent_table_name
from dcp_plus.format.parts import CHUNKED
from dcp_plus.format.record import MAX_RECORD_BYTES, RECORD_NAME, encode_record
from dcp_plus.format.storage_meta import JsonRecordStorageMeta
from dcp_plus.memory.slabs import SlabRef
from dcp_plus.storage.location import StoreClient, sibling_name
from dcp_plus.storage.placement import Placed
from dcp_plus.storage.rate import Bucket, check_shaping, shared_bucket, stagger_delay
from dcp_plus.writers.chunk_encode import DEFAULT_PART_BYTES, ChunkSpec
from dcp_plus.writers.codec_choice import CodecChoice
from dcp_plus.writers.commit_files import committed_by_another, files_written, replaced_files
from dcp_plus.writers.extent_tables import (
    build_extents,
    collect_extents,
    table_prefixes,
    write_results,
)
from dcp_plus.writers.increments import (
    BaseExtents,
    Increments,
    chunked_file,
    encode_files,
    own_extents,
    plan_chunking,
    stored_bytes,
)
from dcp_plus.writers.items import resolve_items
from dcp_plus.writers.layout import FilePlan, checksums_by_item, plan_files
from dcp_plus.writers.pool import DEFAULT_NICE, check_pool_settings, shared_pool
from dcp_plus.writers.save_info import PersistTiming, RankInfo, new_save_id
from dcp_plus.writers.worker import ChunkedJob, Job

log = logging.getLogger(__name__)

Fence = Callable[[], None]
"""Raises when this writer may no longer write where it is (``CheckpointManager``'s lease)."""


class CommittingWriter(StoreClient, StorageWriter):
    """Base of the dcp_plus writers; a subclass opens its store and names its settings.

    In a multi-rank save each rank stores its extent table next to its data and returns a
    single reference, so DCP's gather of write results carries O(1) bytes per rank whatever
    the tensor count; the coordinator reads the tables back in ``finish``, writes the record,
    and (``overwrite=True``) then removes the data files of the record it replaced, and only
    those: files of any other save (one still running, or one that crashed) are never
    touched. A failed ``write_data``, and a commit refused because another save committed
    there first, removes the files of its own save (a fenced writer removes nothing).

    Args (shared by every writer):
        overwrite, codec, codecs, fence, allow_pickle, max_bytes_per_s, stagger: see
            :class:`~dcp_plus.LocalWriter`.
        workers, worker_nice: the shared writer-process pool; ``workers=None``: no pool.

    ``last_persist`` is the :class:`PersistTiming` of this rank's last save (None before).
    """

    _transient: tuple[str, ...] = ("_store_obj", "_feeder")
    """Attributes dropped when DCP pickles the writer into its PROCESS-mode daemon."""
    _bins = 1
    """How many files the data outside stager slabs is spread over."""
    _slab_parts = 1
    """How many files one slab may be cut into (parallel writers never share a file)."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool, codec: str | Codec,
                 codecs: Mapping[str, str | Codec] | None, fence: Fence | None,
                 allow_pickle: bool, workers: int | None = None,
                 worker_nice: int = DEFAULT_NICE, max_bytes_per_s: float | None = None,
                 stagger: float = 0.0, base: str | os.PathLike | None = None,
                 incremental: bool = False, part_bytes: int = DEFAULT_PART_BYTES) -> None:
        super().__init__()
        if workers is not None:
            check_pool_settings(type(self).__name__, workers, worker_nice)
        check_shaping(type(self).__name__, max_bytes_per_s, stagger)
        self._set_location(path)
        self.overwrite = overwrite
        self.codecs = CodecChoice(codec, codecs)
        self.fence = fence
        self.allow_pickle = allow_pickle
        self.workers = workers or 0
        self.worker_nice = worker_nice
        self.max_bytes_per_s = max_bytes_per_s
        self.stagger = stagger
        self.last_persist: PersistTiming | None = None
        self.save_id = new_save_id()
        self.rank = 0
        self.is_coordinator = True
        self._feeder: ThreadPoolExecutor | None = None
        self.increments: Increments | None = None
        if base is not None or incremental:
            self.increments = Increments(
                None if base is None else sibling_name(self.path, base), part_bytes)
        self.last_slabs: dict[MetadataIndex, SlabRef] = {}
        """Where this rank's last save read each slab-backed item (incremental saves only):
        a later save's XOR deltas are taken against those bytes while they last."""
        self.last_extents: BaseExtents | None = None  # and its extents, for a later base

    # -- what a subclass provides -----------------------------------------------------------

    def _worker_jobs(self, files: list[FilePlan], pace: Bucket | None) -> list[Job]:
        """One worker-pool job per slab-backed file; only called for stores that another
        process can write (``uploads_from_any_process``) and writers with ``workers``.
        ``pace``: the save's rate cap, whose ``limit`` the jobs carry."""
        raise NotImplementedError

    def _rank_prefix(self, rank: int) -> str | None:
        """The key prefix of rank ``rank``'s objects (None: beside the record)."""
        return None

    def _prepare(self, names: list[str]) -> list[str]:
        """Before any data is written: the store's preparation of the data files ``names``;
        the files it made, which a failed save removes again."""
        return []

    def _write_in_process(self, files: list[FilePlan], pace: Bucket | None) -> dict[int, str]:
        """Checksum and write ``files`` from this process, paced by ``pace``; the checksums
        by ``id(item)``. One upload of every file: the store spreads it over its own
        requests in flight."""
        sums: dict[int, str] = {}
        objects = []
        for fp in files:
            sums.update((id(r), checksum_bytes(r.data)) for r, _ in fp.placed)
            objects.append((fp.name, segments_of(fp), fp.size))
        if objects:
            self._store.upload(objects, pace)
        return sums

    def plan_cache_key(self) -> str:
        """The writer's part of ``CachedSavePlanner``'s cache key: no setting of a dcp_plus
        writer changes a save plan (planning only attaches each rank's ``RankInfo``), so its
        type alone counts."""
        return ""

    # -- StorageWriter ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self._set_location(checkpoint_id)
        self.save_id = new_save_id()

    def _exists_message(self) -> str:
        return (f"{self.checkpoint_id} already holds a committed checkpoint; pass overwrite=True "
                "to replace it (the old one stays loadable until the new one commits) or save "
                "to a new location")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Runs on every rank, every save (inside DCP's planning step, whose errors reach
        every rank)."""
        if kwargs.get("use_collectives", True) is False:
            # every rank would run finish() and commit a record holding only its own items
            raise CheckpointFormatError(
                f"{self.checkpoint_id}: {type(self).__name__} needs use_collectives=True: the "
                "coordinator commits one record of every rank's data. For a single-process "
                "save use no_dist=True"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.save_id = new_save_id()
        if is_coordinator and self.fence is not None:
            self.fence()  # before anything is written (DCP hands the error to every rank)
        if (is_coordinator and not self.overwrite
                and self._store.sizes([RECORD_NAME])[RECORD_NAME] is not None):
            raise CheckpointExistsError(self._exists_message())

    def storage_meta(self) -> StorageMeta | None:
        """This save's ids, typed to say that this writer never pickles the ``Metadata``."""
        return JsonRecordStorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=RankInfo(i, len(plans)))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        started = time.time()
        info = plan.storage_data
        if not isinstance(info, RankInfo):
            info = RankInfo(self.rank)
        with gc_paused():  # per-item objects, none cyclic: collections here are pure cost
            items = resolve_items(plan, planner, self.allow_pickle)
            raw_lengths = {id(r): len(r.data) for r in items}
            chunking = None if self.increments is None else plan_chunking(
                self, self.increments, items, self.codecs)
            specs = {} if chunking is None else chunking.specs
            codec_names = {id(r): CHUNKED if id(r) in specs else self.codecs.encode(r)
                           for r in items}
            slab_files, other_files = plan_files([r for r in items if id(r) in specs or
                                                  not specs], info.rank, self.save_id,
                                                 self._bins, slab_parts=self._slab_parts)
            if specs:  # values: files of their own, beside the parts
                other_files += plan_files([r for r in items if id(r) not in specs], info.rank,
                                          self.save_id, self._bins,
                                          first=len(slab_files) + len(other_files))[1]
            if self.increments is not None:
                self.last_slabs = {r.item.index: r.slab for r in items if r.slab is not None}
        files = slab_files + other_files
        prefix = self._rank_prefix(info.rank)
        if prefix is not None:
            self._place({n: prefix for n in [fp.name for fp in files]
                         + [extent_table_name(info.rank, self.save_id)]})
        # the persist's own thread waits (async saves: not the trainer's); planning and the
        # commit are not held back, only this rank's data write
        delay = stagger_delay(self.stagger, info.rank)
        if delay > 0:
            time.sleep(delay)
        writing, clock = time.time(), time.monotonic()
        created = self._prepare([fp.name for fp in files])
        try:
            with shared_bucket(self.max_bytes_per_s) as pace:
                sums = self._write_files(slab_files, other_files, pace, specs)
            self.last_persist = PersistTiming(started, writing, time.monotonic() - clock,
                                              stored_bytes(files, specs, sums))
            with gc_paused():
                extents = build_extents([fp for fp in files if not chunked_file(fp, specs)],
                                        raw_lengths, codec_names, sums, prefix)
                if chunking is not None:
                    extents += [(r.item.index, chunking.extent(r, fp.name, sums[id(r)]))
                                for fp in files if chunked_file(fp, specs) for r, _ in fp.placed]
                    # a file of nothing but references holds nothing: no record names it
                    named = {e.file for _, e in extents if e.base is None}
                    self._remove_own_files([fp.name for fp in files if fp.name not in named])
                    self.last_extents = own_extents(items, extents)
                results = write_results(info.rank, info.world, self.save_id, extents,
                                        self._put_table, prefix)
        except BaseException:
            self._remove_own_files(created)
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(self, slab_files: list[FilePlan], other_files: list[FilePlan],
                     pace: Bucket | None, specs: dict[int, ChunkSpec]) -> dict[int, Any]:
        """Write the planned files, every byte paced by ``pace`` (None: uncapped); by
        ``id(item)``, the content checksums, or for items stored as parts (``specs``) their
        outcomes. Slab-backed files go to the worker pool (on this thread) while the rest
        are written on a feeder thread."""
        store = self._store
        in_workers = slab_files if self.workers and store.uploads_from_any_process else []
        in_process = other_files if in_workers else slab_files + other_files
        if not in_workers:
            return self._write_encoded(in_process, pace, specs)
        if self._feeder is None:
            self._feeder = ThreadPoolExecutor(1, thread_name_prefix="dcpp-upload")
        pending = self._feeder.submit(self._write_encoded, in_process, pace, specs)
        try:
            # one job per file: never two writers to one
            jobs: list[Job | ChunkedJob] = list(self._worker_jobs(in_workers, pace))
            if specs:
                jobs = [ChunkedJob(job, [specs[id(r)] for r, _ in fp.placed])  # type: ignore
                        for job, fp in zip(jobs, in_workers, strict=True)]
            sums = checksums_by_item(in_workers,
                                     shared_pool(self.workers, self.worker_nice).run(jobs))
        finally:
            wait([pending])  # no thread may still write when this returns or raises
        sums.update(pending.result())
        return sums

    def _write_encoded(self, files: list[FilePlan], pace: Bucket | None,
                       specs: dict[int, ChunkSpec]) -> dict[int, Any]:
        """:meth:`_write_in_process`, items stored as parts (``specs``) encoded first."""
        if not specs:
            return self._write_in_process(files, pace)
        files, outcomes = encode_files(files, specs)
        sums: dict[int, Any] = dict(self._write_in_process(files, pace))
        sums.update(outcomes)
        return sums

    def _discard(self, extents: Mapping[MetadataIndex, Extent], tables: list[str]) -> None:
        """Before a refused or failed commit returns: every file of this save (all ranks'
        data files and extent tables)."""
        files = files_written(extents)
        try:
            self._place({f: p for f, p in files.items() if p is not None})
        except (ValueError, DcpPlusError) as e:
            log.warning("%s: the files of the save %s that did not commit stay in place: %s",
                        self.checkpoint_id, self.save_id, e)
            return
        self._remove_own_files(sorted(files) + tables)

    def _remove_own_files(self, names: list[str]) -> None:
        """After a failed write or commit: the files this save made. A failure here is
        logged, not raised over the error that got us here."""
        if not names:
            return
        try:
            self._store.delete(names)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not remove the files of the failed save %s: %s",
                        self.checkpoint_id, self.save_id, e)

    def _place(self, files: dict[str, str]) -> None:
        """Objects ``files`` lie under their key prefixes (stores that have none refuse)."""
        if not files:
            return
        store = self._store
        if not isinstance(store, Placed):
            raise CheckpointFormatError(f"{self.checkpoint_id}: {type(self).__name__} keeps no "
                                        "objects under key prefixes")
        store.place(files)

    def _put_table(self, name: str, data: bytes) -> None:
        self._store.put(name, data, if_absent=False)

    def _get_table(self, name: str) -> bytes:
        data = self._store.get(name)
        if data is None:
            raise CheckpointFormatError(f"{self._store.location(name)}: extent table missing")
        return data

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._store
        self._place(table_prefixes(results))
        extents, tables = collect_extents(results, self._get_table, store.location)
        metadata.storage_data = extents
        metadata.storage_meta = self.storage_meta()
        metadata.version = CURRENT_DCP_VERSION
        record = encode_record(metadata, extents)
        if len(record) > MAX_RECORD_BYTES:  # no reader would accept it: never commit it
            if self.fence is not None:
                self.fence()  # a fenced writer removes nothing
            self._discard(extents, tables)
            raise CheckpointFormatError(
                f"{self.checkpoint_id}: the commit record would be {len(record)} bytes, more "
                f"than readers accept ({MAX_RECORD_BYTES}); save fewer items, or with "
                "incremental checkpoints larger parts or shorter chains (full_every)")
        keep = self.increments is not None and self.increments.keep_replaced
        replaced = set() if keep or not self.overwrite else replaced_files(
            store.get(RECORD_NAME), self.checkpoint_id, isinstance(store, Placed), self._place)
        if self.fence is not None:
            # a writer fenced off while this save ran must not commit it, nor remove anything:
            # the root is the new holder's, whose start-up clean-up takes this save's files
            self.fence()
        # a put that raises may still have committed: its files stay (not so a refused one)
        if not store.put(RECORD_NAME, record, if_absent=not self.overwrite):
            if committed_by_another(partial(store.get, RECORD_NAME), record, self.checkpoint_id):
                self._discard(extents, tables)
            raise CheckpointExistsError(self._exists_message() + " (it was committed while "
                                        "this save was running)")
        store.delete(tables)
        stale = sorted(replaced - extent_files(extents)) if replaced else []
        if stale:
            store.delete(stale)
            log.info("%s: removed %d data files of the checkpoint this commit replaced",
                     self.checkpoint_id, len(stale))

    def close(self) -> None:
        """Release this writer's store and threads (reopened on next use). The shared worker
        pool stays up for other writers; ``dcp_plus.writers.shutdown_pool`` stops it."""
        if self._feeder is not None:
            self._feeder.shutdown(wait=True)
            self._feeder = None
        self._close_store()



def segments_of(fp: FilePlan) -> list[tuple[int, memoryview]]:
    """``(offset, bytes)`` of the items placed in ``fp`` (empty ones write nothing)."""
    return [(off, r.data) for r, off in fp.placed if len(r.data)]
