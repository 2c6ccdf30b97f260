"""TorchTitan's ``CheckpointManager`` with saves and loads routed through dcp_plus.

Imported only through :mod:`dcp_plus.integrations.torchtitan`, which checks that TorchTitan is
installed first. See ``docs/torchtitan.md``.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem

from dcp_plus.integrations._titan_adaptive import AdaptiveSaves
from dcp_plus.integrations._titan_config import DcpPlusConfig, incremental_options
from dcp_plus.integrations._titan_errors import stock_checkpoint_hint
from dcp_plus.integrations._titan_increments import TitanIncrements, purge_list
from dcp_plus.integrations._titan_schedule import LoopSchedule
from dcp_plus.integrations._titan_tiers import TitanTiers
from dcp_plus.manager.control import ControlGroup
from dcp_plus.manager.object_backend import ObjectStoreBackend
from dcp_plus.manager.options import LocalWriterOptions, ObjectStoreWriterOptions
from dcp_plus.manager.storage import Backend, LocalBackend
from dcp_plus.planners import CachedSavePlanner, SafeLoadPlanner
from dcp_plus.stagers import ArenaStager
from dcp_plus.stagers.device_copy import check_device_copy
from dcp_plus.storage.urls import is_url
from dcp_plus.tiers import Restore
from dcp_plus.tiers.recovery import DURABLE
from dcp_plus.writers import shutdown_pool

log = logging.getLogger(__name__)

_DIRECT_IO: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}


@dataclass(slots=True)
class SaveRecord:
    """What one save cost the training loop (kept in ``DcpPlusCheckpointManager.saves``)."""

    step: int
    mode: str
    """``async``, ``async_with_pinned_mem``, ``disabled`` or ``last``."""
    blocking_s: float
    """Time ``save()`` held the training loop (flatten, stage submission, plan; for
    ``disabled`` and ``last`` the whole write)."""
    staging_wait_s: float = 0.0
    """Time the next ``maybe_wait_for_staging()`` (before ``optimizer.step()``) waited."""
    plan_cache_hit: bool | None = None
    """Whether every rank reused a cached plan (known once the save has finished)."""
    durable: bool = True
    """Whether it was persisted to its step folder (False: kept in the memory tier only)."""


class DcpPlusCheckpointManager(AdaptiveSaves, CheckpointManager):
    """TorchTitan's DCP checkpoint manager, saving and loading through dcp_plus.

    Saves stage into an :class:`~dcp_plus.stagers.ArenaStager` (async modes), plan with a
    :class:`~dcp_plus.planners.CachedSavePlanner` and write with
    :class:`~dcp_plus.writers.LocalWriter` (or ``ObjectStoreWriter`` for URLs). Loads read
    with :class:`~dcp_plus.readers.LocalReader` (checksums verified) and
    :class:`~dcp_plus.planners.SafeLoadPlanner` (no unpickling). Everything else is
    TorchTitan's: step folders ``step-N``, ``interval``, ``keep_latest_k``, ``load_step``,
    ``exclude_from_loading``, ``initial_load_path``, the model-only last save (HF export
    included), and the train-state / dataloader / LR-scheduler states it saves.

    ``async_mode="async"`` and ``"async_with_pinned_mem"`` both stage into the arena (pinned
    by the stager itself when tensors are on CUDA); ``"disabled"`` writes synchronously with
    the same writer and planner.

    With ``memory_tier`` (and ``peer_tier``) every save is kept in shared memory (and a
    partner's) and only every ``durable_every``-th is persisted to its step folder; resume
    restores from the fastest tier every rank has, as ``dcp_plus.manager.CheckpointManager``
    does, and reports it in ``last_restore`` (``docs/tiers.md``).
    """

    staging_future: Future | None
    save_future: Future | None

    @dataclass(kw_only=True, slots=True)
    class Config(DcpPlusConfig):
        """Settings: TorchTitan's and dcp_plus's (fields and checks in
        :class:`~dcp_plus.integrations._titan_config.DcpPlusConfig`)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.dcpp = config
        self.saves: list[SaveRecord] = []
        # one planner for full and model-only (last-step) saves: its cache holds both
        self._planner = self._make_save_planner()
        self.stager: ArenaStager | None = None  # type: ignore[assignment]
        if self.async_mode != AsyncMode.DISABLED or config.memory_tier:
            # the memory tier keeps the newest snapshot in one buffer while the next is taken
            # (with async_mode "disabled" too: its snapshot is the stager's, waited for)
            self.stager = ArenaStager(buffers=2 if config.memory_tier else config.stager_buffers,
                                      max_bytes=config.stager_max_bytes,
                                      num_threads=config.stager_threads,
                                      executor=config.async_executor,
                                      device_copy=check_device_copy(config.stager_device_copy))
        self._executor = (AsyncCheckpointerType.PROCESS if config.async_executor == "process"
                          else AsyncCheckpointerType.THREAD)
        # the writer settings of either backend, checked now rather than at the first save
        shaping: dict[str, Any] = {"max_bytes_per_s": config.writer_max_bytes_per_s,
                                   "stagger": config.writer_stagger}
        self._writer_options: dict[type, Any] = {
            LocalWriterOptions: LocalWriterOptions(
                workers=config.writer_workers, threads=config.writer_threads,
                fsync=config.fsync, codec=config.compression,
                direct_io=_DIRECT_IO[config.writer_direct_io], streams=config.writer_streams,
                **shaping),
            ObjectStoreWriterOptions: ObjectStoreWriterOptions(codec=config.compression,
                                                               **shaping)}
        if is_url(self.folder) and config.storage_options:
            log.warning("dcp_plus: checkpoint.storage_options reach dcp_plus's writer and "
                        "reader only; TorchTitan lists %s itself (resume step, keep_latest_k) "
                        "through fsspec without them: put the endpoint and credentials in "
                        "fsspec's config too (e.g. FSSPEC_S3='{...}')", self.folder)
        self._increments = (TitanIncrements(incremental_options(config),
                                            config.incremental_part_bytes)
                            if config.incremental else None)
        self._schedule: LoopSchedule | None = None
        self._tiers: TitanTiers | None = None
        self._finished = False  # the last step was saved: close() frees the memory tier
        self.last_restore: Restore | None = None
        """What the last resume did: the step, each rank's tier, seconds (None: fresh)."""
        self._ctl: ControlGroup | None = None
        if self.load_only or (config.adaptive_budget is None and not config.memory_tier):
            return
        # rank-0 decisions and restore agreement: a gloo group of their own (async uploads
        # run collectives on ``self.pg`` from a background thread, and gloo aborts on
        # interleaved collectives)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._ctl = ControlGroup()
        if config.adaptive_budget is not None:
            self._init_adaptive(config.adaptive_budget, config.adaptive_warmup)
        if config.memory_tier:
            assert self.stager is not None  # made above for the memory tier
            self._tiers = TitanTiers(config.tier_options(), self.folder, self.stager,
                                     self._planner, self.pg, self._ctl)

    # -- factories ----------------------------------------------------------------------

    def _make_save_planner(self) -> DefaultSavePlanner:
        if self.dcpp.planner == "cached":
            return CachedSavePlanner(cache_size=self.dcpp.plan_cache_size)
        return DefaultSavePlanner()

    def _backend(self, path: str) -> Backend:
        """The manager's storage backend for ``path``: the object store's for a URL (with
        ``writer="auto"``) or with ``writer="object_store"``, the local one otherwise."""
        kind = self.dcpp.writer
        if kind == "object_store" or (kind == "auto" and is_url(path)):
            return ObjectStoreBackend(self.dcpp.storage_options)
        return LocalBackend()

    def make_writer(self, checkpoint_id: str) -> StorageWriter:
        """The storage writer for one save (a new one per save, as DCP expects)."""
        # the backend's writers overwrite: like TorchTitan's FileSystemWriter, a save replaces
        # the same step's checkpoint (e.g. after resuming from an earlier load_step); the old
        # one stays loadable until the new commit record is in place.
        backend = self._backend(checkpoint_id)

        def make() -> StorageWriter:
            return backend.writer(checkpoint_id,
                                  self._writer_options[backend.writer_options].kwargs())
        if self._increments is None:
            return make()
        return self._increments.writer(make, checkpoint_id, backend)

    def _purge_stale_checkpoints(self) -> None:
        """TorchTitan's ``keep_latest_k`` purge; with incremental checkpoints it spares the
        step folders the kept ones (and the save in flight) reference."""
        if self._increments is None:
            CheckpointManager._purge_stale_checkpoints(self)
            return
        if not self._should_purge():
            return
        found = sorted((int(m.group(1)), filesystem.join(self.folder, n))
                       for n in filesystem.listdir(self.folder)
                       if (m := re.search(r"step-(\d+)", n)))
        paths = [p for _, p in found]
        k = self.keep_latest_k
        for path in purge_list(paths[:-k], paths[-k:], self._increments,
                               self._backend(self.folder)):
            self.purge_queue.put(path)

    def make_reader(self, checkpoint_id: str) -> StorageReader:
        """The storage reader for one load."""
        backend = self._backend(checkpoint_id)
        options = backend.reader_options(verify=self.dcpp.verify_on_load).kwargs()
        if isinstance(backend, LocalBackend):  # stock-DCP checkpoints: local folders only
            options["allow_pickle"] = self.dcpp.allow_pickle_on_load
        return backend.reader(checkpoint_id, options)

    # -- save -----------------------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Future | AsyncSaveResponse | None:
        """One DCP save through dcp_plus; the HF export path stays TorchTitan's."""
        if to_hf:
            return CheckpointManager.dcp_save(self, state_dict, checkpoint_id, async_mode,
                                              enable_garbage_collection, to_hf)
        writer = self.make_writer(checkpoint_id)
        if isinstance(self._planner, CachedSavePlanner):
            self._planner.set_save_context(storage_writer=writer, process_group=self.pg)
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer, planner=self._planner)
            return None
        resp = dcp.async_save(state_dict, storage_writer=writer, planner=self._planner,
                              process_group=self.pg, async_stager=self.stager,
                              async_checkpointer_type=self._executor)
        if isinstance(resp, AsyncSaveResponse) and self.stager is not None:
            self.stager.release_when(resp.upload_completion)
        return resp

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        t0 = time.monotonic()
        self.maybe_wait_for_saving()
        waited = time.monotonic() - t0
        if self.saves and self.saves[-1].durable and isinstance(self._planner,
                                                                CachedSavePlanner):
            self.saves[-1].plan_cache_hit = self._planner.last_was_hit
            log.info("dcp_plus: step %d save reused its cached plan: %s", self.saves[-1].step,
                     self._planner.last_was_hit)
        begin = time.monotonic()
        if last_step:
            self._save_last_step(curr_step)
            self._finished = True
            self._record(SaveRecord(curr_step, "last", time.monotonic() - begin))
            self._report(curr_step, waited, None, None)
            return True
        durable = self._issue(curr_step)
        self._purge_stale_checkpoints()
        self._record(SaveRecord(curr_step, self.async_mode.value, time.monotonic() - begin,
                                durable=durable))
        what = "saved" if self.save_future is None else "staged"
        if self._tiers is not None:
            what += " (memory tier and step folder)" if durable else " (memory tier only)"
        log.info("dcp_plus: step %d checkpoint %s in %.3f s (blocking)", curr_step, what,
                 self.saves[-1].blocking_s)
        self._report(curr_step, waited, self.staging_future, self.save_future)
        return True

    def _issue(self, step: int) -> bool:
        """Start the save of ``step`` (through the tiers when they are on) and set the
        staging and save futures; returns whether it is persisted to its step folder."""
        states = self._flattened_model_states_sd()
        checkpoint_id = self._create_checkpoint_id(step)
        if self._tiers is not None:
            started = self._tiers.save(step, states, lambda: self.make_writer(checkpoint_id))
            self.staging_future, self.save_future = started.staged, started.done
            if self.async_mode == AsyncMode.DISABLED:  # a blocking save, through the tiers
                started.done.result()
                self.staging_future = self.save_future = None
            return started.durable
        result = self.dcp_save(states, checkpoint_id=checkpoint_id, async_mode=self.async_mode)
        if isinstance(result, AsyncSaveResponse):
            self.staging_future = result.staging_completion
            self.save_future = result.upload_completion
        return True

    def _record(self, rec: SaveRecord) -> None:
        self.saves.append(rec)

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is None:
            return
        begin = time.monotonic()
        assert self.stager is not None
        self.stager.synchronize_staging()  # in GPU mode: the device copy, not the host copy
        self.staging_future = None  # (a failed snapshot fails the save's upload future too)
        waited = time.monotonic() - begin
        if self.saves:
            self.saves[-1].staging_wait_s += waited
        if self._schedule is not None:
            self._schedule.staging_waited(waited)

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        self.save_future.result()
        self.save_future = None

    # -- load -----------------------------------------------------------------------------

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        """One DCP load through dcp_plus's reader and SafeLoadPlanner (HF loads unchanged)."""
        if from_hf:
            CheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
            return
        planner = (DefaultLoadPlanner() if self.dcpp.allow_pickle_on_load
                   else SafeLoadPlanner())
        with stock_checkpoint_hint(checkpoint_id):
            dcp.load(state_dict, storage_reader=self.make_reader(checkpoint_id), planner=planner)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Resume (``step`` -1) with the memory tier: the newest step every rank can restore,
        each rank from its own memory, its partner's replica or the step folder, as
        ``dcp_plus.manager.CheckpointManager.load_latest`` does; otherwise TorchTitan's."""
        if self._tiers is None or step != -1:
            return CheckpointManager._load(self, step)
        begin = time.monotonic()
        states = self._states_to_load(model_only=False)
        newest = self._find_load_step()  # TorchTitan's durable candidate (-1: none)
        done = self._tiers.restore(states, [newest] if newest >= 0 else [],
                                   self._create_checkpoint_id, self.make_reader)
        if done is None:  # no snapshot anywhere: TorchTitan's resume, initial load or start
            return CheckpointManager._load(self, -1)
        if all(t == DURABLE for t in done.tiers):
            CheckpointManager._load(self, done.step)  # TorchTitan's load, collective
        elif MODEL in self.states:
            self.states[MODEL].load_state_dict(states)  # model states are flattened
        self.last_restore = Restore(done.step, done.tiers, time.monotonic() - begin)
        log.info("dcp_plus: restored step %d from %s (tier per rank) in %.2f s", done.step,
                 done.tiers, self.last_restore.seconds)
        return True

    # -- teardown ---------------------------------------------------------------------------

    def _close(self) -> None:
        try:
            if self.save_future is not None:
                self.save_future.result()
                self.save_future = None
        finally:
            tiers, self._tiers = getattr(self, "_tiers", None), None
            if tiers is not None:  # a job that did not finish keeps them for its restart
                tiers.close(remove=self._finished)
            CheckpointManager._close(self)  # closes self.stager and the purge thread
            shutdown_pool()  # the shared writer processes (restarted on next use)

