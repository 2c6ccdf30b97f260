"""``CheckpointManager``: naming, async save, commit, ``latest``, retention, resume, interval.

See ``docs/manager.md`` for the life cycle of one checkpoint and the crash guarantees.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus.errors import ClosedError, DcpPlusError, ReadOnlyError
from dcp_plus.manager.control import ControlGroup
from dcp_plus.manager.handle import SaveHandle
from dcp_plus.manager.increments import Chain, IncrementalOptions
from dcp_plus.manager.issuing import Issuer, wait_snapshot
from dcp_plus.manager.lease import DEFAULT_TIMEOUT_S
from dcp_plus.manager.options import ReaderOptions, WriterOptions, check_limits, options_for
from dcp_plus.manager.resume import load_fastest, tiers_for
from dcp_plus.manager.root import CheckpointRoot
from dcp_plus.manager.root_lease import acquire_for_job, still_held
from dcp_plus.manager.saving import Completion, SaveHistory
from dcp_plus.manager.storage import Backend, backend_for
from dcp_plus.planners import CachedSavePlanner
from dcp_plus.schedule import AdaptiveInterval, EveryN, IntervalPolicy, SaveStats
from dcp_plus.stagers import ArenaStager
from dcp_plus.tiers import Restore, TierOptions

log = logging.getLogger(__name__)

_List = list  # CheckpointManager.list() shadows the builtin in the class body
PhaseHook = Callable[[str, int], None]
PHASES = ("stage", "memory", "persist", "commit", "retention", "done")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint under the manager's root."""

    step: int
    path: str


class CheckpointManager:
    """Periodic asynchronous checkpoints of one training job, and resume.

    Args:
        root: directory (or ``file://`` URL) holding ``step_XXXXXXXX/`` checkpoints and the
            ``latest`` pointer. Other schemes plug in with
            :func:`dcp_plus.manager.storage.register_scheme`.
        writer_options: settings of the writer of each checkpoint: ``LocalWriterOptions``
            for a local root, ``ObjectStoreWriterOptions`` for an object-store URL (both in
            :mod:`dcp_plus.manager.options`; default: their defaults). Settings of the other
            writer, or a bad value, raise ``InvalidOptionError`` here.
        reader_options: likewise for the reader (``LocalReaderOptions`` /
            ``ObjectStoreReaderOptions``).
        storage_options: passed untouched to the backend (object stores: credentials).
        keep_last: committed checkpoints kept by retention (``None``: keep all). The newest
            committed checkpoint is never deleted.
        keep_every: also keep every step that is a multiple of this.
        interval: the policy ``maybe_save`` asks: an ``IntervalPolicy``, an int (``EveryN``),
            or ``None`` for ``AdaptiveInterval(p=0.05)``.
        process_group: ranks that checkpoint together (default: the whole world when
            ``torch.distributed`` is initialized). The manager makes its own gloo groups of
            these ranks, so background saves never collide with training collectives.
        stager: an ``ArenaStager`` to use (default: one owned and closed by the manager).
        verify_on_load: re-checksum a candidate before ``load_latest`` picks it.
        on_phase: ``hook(phase, step)`` called at each phase of a save (``stage`` on the
            calling thread; ``persist``, ``commit``, ``retention``, ``done`` on the manager's
            thread; ``memory`` too with a memory tier); for observability and
            fault-injection tests.
        clock: time source for the measurements (seconds).
        read_only: only list and load (an evaluation job polling a trainer's root): never
            writes, deletes or takes the lease; ``save()`` raises ``ReadOnlyError``.
        takeover: take the root's lease over when its holder is dead (its pid is gone from
            this host, or its heartbeat is older than ``lease_timeout``); a live holder is
            never displaced. A restarted job passes it after a crash.
        lease_timeout: seconds without a heartbeat after which a writer on another host is
            considered dead.
        history_size: how many recent ``SaveStats`` ``history`` keeps.
        memory_tier, durable_every, job_id, peer_tier, ranks_per_node, partner,
            memory_tier_bytes: the memory and peer tiers, see
            :class:`~dcp_plus.tiers.TierOptions` and ``docs/tiers.md`` (``memory_tier_bytes``
            is its ``state_bytes``). ``load_latest`` then restores from the fastest tier and
            ``last_restore`` says which each rank used.
        incremental, full_every, delta: incremental checkpoints (``IncrementalOptions``,
            ``docs/incremental.md``); retention keeps every checkpoint a kept one references.

    One root has one writer: a writing manager holds the root's lease (``ROOT/.dcpp-lease``)
    until ``close()``; a second one raises ``LeaseHeldError`` naming the holder. A manager
    whose lease was taken over is fenced: its next save fails with ``LeaseLostError`` before
    writing, a save in flight is not committed, and it deletes nothing more.

    A ``save`` issued while the previous persist is still in flight first waits for it to
    finish (at most one persist is in flight; the wait counts as exposed checkpoint cost), or
    returns ``None`` at once with ``if_busy="skip"``.
    """

    def __init__(self, root: str | os.PathLike, *, writer_options: WriterOptions | None = None,
                 reader_options: ReaderOptions | None = None,
                 storage_options: Mapping[str, Any] | None = None, keep_last: int | None = 3,
                 keep_every: int | None = None, interval: IntervalPolicy | int | None = None,
                 process_group: Any = None, stager: ArenaStager | None = None,
                 verify_on_load: bool = True, on_phase: PhaseHook | None = None,
                 clock: Callable[[], float] = time.perf_counter, read_only: bool = False,
                 takeover: bool = False, lease_timeout: float = DEFAULT_TIMEOUT_S,
                 history_size: int = 1000, memory_tier: bool = False, durable_every: int = 1,
                 job_id: str | None = None, peer_tier: bool = False,
                 ranks_per_node: int | None = None, partner: Callable[[int], int] | None = None,
                 memory_tier_bytes: int | None = None, incremental: bool = False,
                 full_every: int = 8, delta: bool = False) -> None:
        tier_options = TierOptions(memory_tier, durable_every, job_id, peer_tier,
                                   ranks_per_node, partner, memory_tier_bytes)
        check_limits(keep_last, history_size, lease_timeout)
        backend, self.root = backend_for(root, storage_options)
        self._checkpoints = CheckpointRoot(backend, self.root)
        self.writer_options: WriterOptions = options_for(
            writer_options, backend.writer_options, "writer_options", self.root)
        self.reader_options: ReaderOptions = options_for(
            reader_options, backend.reader_options, "reader_options", self.root)
        self._chain = Chain(IncrementalOptions(incremental, full_every, delta),
                            self.writer_options.part_bytes, getattr(self.writer_options,
                                                                    "key_prefixes", None))
        self.keep_last, self.keep_every = keep_last, keep_every
        self.policy: IntervalPolicy = (AdaptiveInterval(0.05) if interval is None else
                                       EveryN(interval) if isinstance(interval, int) else interval)
        self.verify_on_load = verify_on_load
        self.on_phase = on_phase
        self.clock = clock
        self._dist = dist.is_available() and dist.is_initialized()
        self._group: Any = None
        self._ctl: ControlGroup | None = None
        self.rank, self.world_size = 0, 1
        if self._dist:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            # saves run in a background thread: they get a group of their own, and decisions
            # and resume agreement get another (gloo aborts on interleaved collectives)
            self._group = dist.new_group(ranks=ranks, backend="gloo")
            self._ctl = ControlGroup(ranks)
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
        self.is_coordinator = self.rank == 0
        self.read_only = read_only
        self._lease = None if read_only else acquire_for_job(
            backend, self.root, coordinator=self.is_coordinator, ctl=self._ctl,
            takeover=takeover, timeout_s=lease_timeout)
        self._owns_stager = stager is None and not read_only
        self._stager = stager if stager is not None or read_only else ArenaStager(
            buffers=2 if memory_tier or delta else 1, executor="other" if memory_tier else "thread")
        self._planner = CachedSavePlanner()
        self._tiers = tiers_for(tier_options, self.root, self.rank, self.world_size, self._stager,
                                None if process_group is None else
                                dist.get_process_group_ranks(process_group))
        self._issuer = Issuer(self._stager, self._planner, self._group, self._dist, self._tiers)
        self.last_restore: Restore | None = None
        """What the last ``load_latest`` did: step, each rank's tier, seconds."""
        self._post = ThreadPoolExecutor(1, thread_name_prefix="dcpp-manager")
        self._inflight: SaveHandle | None = None
        self._staging: SaveHandle | None = None
        saves = SaveHistory(history_size)
        self.history: _List[SaveStats] = saves.items
        """The most recent saves' stats, oldest first (at most ``history_size``)."""
        self._completed = saves.unread  # for the policy, drained by maybe_save
        self._finish = Completion(
            self._checkpoints, saves, clock=clock, phase=self._phase,
            coordinator=self.is_coordinator, lease_held=lambda: still_held(self._lease, self.root),
            keep_last=keep_last, keep_every=keep_every)
        self._guards: _List[Any] = []
        self._guarded = False
        self._last_tick: float | None = None
        self._iter_checkpoint_s = 0.0
        self._iter_update_s: float | None = None
        self._update_t0: float | None = None
        self._closed = False
        self.history_size = history_size
        self.cleaned: _List[str] = []
        try:
            if self.is_coordinator and self._lease is not None:
                # the lease holder alone cleans up, before any save of its own has started
                self._lease.check()
                self.backend.makedirs(self.root)
                self.cleaned = self._checkpoints.clean_uncommitted()
                self._checkpoints.repair_pointer()
            if self._ctl is not None:
                self._ctl.barrier()
        except BaseException:
            self.close()  # gives the lease back: a retry in this process must not find it held
            raise

    @property
    def backend(self) -> Backend:
        """The storage backend of the root (chosen by its URL scheme)."""
        return self._checkpoints.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._checkpoints.backend = backend

    @property
    def took_over(self) -> str | None:
        """Who held the root's lease before this manager took it over (``takeover=True``),
        or None."""
        held = None if self._lease is None else self._lease.took_over
        return None if held is None else held.describe()

    # -- saving ---------------------------------------------------------------------------

    def guard(self, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> None:
        """Make ``optimizer.step()`` wait for the snapshot in flight (the consistency rule),
        and measure the weight-update time and the exposed staging time for the policy.

        Without a guard, ``save()`` waits for its snapshot before returning.
        """
        self._check_writable("guard")
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        for opt in opts:
            self._guards.append(opt.register_step_pre_hook(self._pre_step))
            self._guards.append(opt.register_step_post_hook(self._post_step))
        self._guarded = True

    def save(self, step: int, state: dict[str, Any], *,
             if_busy: str = "wait") -> SaveHandle | None:
        """Snapshot ``state`` and persist it in the background as checkpoint ``step``.

        Returns a :class:`SaveHandle`; storage errors never raise here, they fail
        ``handle.done`` with ``CheckpointSaveError``. With ``if_busy="skip"`` returns ``None``
        instead of waiting when the previous persist is still in flight.
        """
        self._check_open("save")
        self._check_writable("save")
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        t0 = self.clock()
        prev = self._inflight
        if prev is not None and not prev.done.done():
            if if_busy == "skip":
                return None
            wait_futures([prev.done])
        t_start = self.clock()
        path = self._checkpoints.path(step)
        handle = SaveHandle(step, path, started_at=t_start, waited_s=t_start - t0)
        self._phase("stage", step)
        fence = self._lease.check if self._lease is not None else None
        try:
            issued = self._issuer.issue(step, state, lambda: self._chain.writer(
                lambda: self.backend.writer(path, {**self.writer_options.kwargs(),
                                                   "fence": fence}), path, handle.committed))
        except (Exception, CheckpointException) as e:  # staging refused, storage unusable
            handle.blocking_s = self.clock() - t0
            self._completed.append(self._finish.refused(handle, e))
            return handle
        staged = issued.staged
        stager = self._stager if isinstance(self._stager, ArenaStager) else None
        staged.add_done_callback(lambda f: self._finish.staged(handle, f, stager))
        self._inflight = self._staging = handle
        if not self._guarded:
            wait_snapshot(staged, stager)
        handle.blocking_s = self.clock() - t0
        self._iter_checkpoint_s += handle.blocking_s
        self._post.submit(self._finish.complete, handle, issued)
        return handle

    def maybe_save(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        """Call once per iteration: feeds the policy its measurements, saves when it says so."""
        self._check_open("maybe_save")
        self._check_writable("maybe_save")
        now = self.clock()
        if self._last_tick is not None:
            self.policy.observe_iteration(now - self._last_tick, self._iter_checkpoint_s,
                                          self._iter_update_s)
        self._last_tick = now
        self._iter_checkpoint_s = 0.0
        self._iter_update_s = None
        while self._completed:
            self.policy.observe_save(self._completed.popleft())
        if not self._decide(step):
            return None
        return self.save(step, state)

    def wait(self, timeout: float | None = None) -> SaveHandle | None:
        """Wait until the save in flight has committed or failed; returns its handle."""
        h = self._inflight
        if h is not None:
            wait_futures([h.done], timeout=timeout)
        return h

    # -- resuming -------------------------------------------------------------------------

    def list(self) -> _List[CheckpointInfo]:
        """Committed checkpoints under the root, oldest first."""
        return [CheckpointInfo(s, self._checkpoints.path(s))
                for s in sorted(self._checkpoints.committed())]

    def latest_step(self) -> int | None:
        """The step the ``latest`` pointer names (advanced only after a commit)."""
        return self._checkpoints.latest_step()

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load, in place, the newest checkpoint that is committed, verified and loadable by
        every rank; returns its step, or ``None`` when there is none.

        Ranks agree by collectives: the candidates are the union of every rank's committed
        steps, newest first; a candidate is taken only if every rank verified it, and skipped
        if loading it fails anywhere (``state`` is then overwritten by the next candidate).
        """
        self._check_open("load_latest")
        self.wait()
        options = self.reader_options.kwargs()
        self.last_restore = load_fastest(
            self._tiers, self._checkpoints, state,
            reader=lambda path: self.backend.reader(path, options), verify=self.verify_on_load,
            ctl=self._ctl, group=self._group, rank=self.rank, world_size=self.world_size,
            clock=self.clock)
        return None if self.last_restore is None else self.last_restore.step

    # -- life cycle -----------------------------------------------------------------------

    def close(self, *, keep_snapshots: bool = False) -> None:
        """Wait for the save in flight, then free the stager, threads and writer workers and
        release the root's lease; remove this rank's memory-tier snapshots unless
        ``keep_snapshots`` (leaving a ``with`` block by an exception keeps them, for the
        restart)."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        if self._tiers is not None:
            self._tiers.close(remove=not keep_snapshots)
        for h in self._guards:
            h.remove()
        self._guards = []
        self._post.shutdown(wait=True)
        if self._owns_stager and self._stager is not None:
            self._stager.close()
        if self._lease is not None:
            self._lease.release()
        if not self.read_only:
            from dcp_plus.writers import shutdown_pool

            shutdown_pool()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(keep_snapshots=exc_type is not None)

    # -- internals ------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"CheckpointManager.{what}() called after close() "
                              f"(root {self.root}); create a new manager")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyError(f"CheckpointManager.{what}() on a read-only manager (root "
                                f"{self.root}); the root's writer is the process holding its "
                                "lease")

    def _phase(self, phase: str, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, step)

    def _decide(self, step: int) -> bool:
        """The policy's answer; in a job, rank 0's answer for every rank (a broadcast), unless
        the policy depends on the step alone."""
        want = self.policy.should_save(step)
        if self._ctl is None or isinstance(self.policy, EveryN):
            return want
        return self._ctl.rank0_decides(want)

    def _pre_step(self, *_: Any) -> None:
        t0 = self.clock()
        try:
            assert self._stager is not None
            self._stager.synchronize_staging()
        except DcpPlusError as e:  # also fails the save's handle; training goes on
            log.warning("snapshot failed: %s", e)
        waited = self.clock() - t0
        self._iter_checkpoint_s += waited
        if self._staging is not None:
            self._staging.exposed_staging_s += waited
            self._staging = None
        self._update_t0 = self.clock()

    def _post_step(self, *_: Any) -> None:
        if self._update_t0 is not None:
            self._iter_update_s = (self._iter_update_s or 0.0) + self.clock() - self._update_t0
            self._update_t0 = None
