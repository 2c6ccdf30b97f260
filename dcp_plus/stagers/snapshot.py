"""One snapshot on the copy engine's driver thread: take a buffer, copy, resolve the future."""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from dcp_plus.errors import DcpPlusError, StagingError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.stagers.arena import Arena, Buffer, fingerprint
from dcp_plus.stagers.arenas import ArenaSet
from dcp_plus.stagers.copy_engine import CopyEngine
from dcp_plus.stagers.device_copy import DeviceCopyPolicy, Mirror
from dcp_plus.stagers.holds import Holds
from dcp_plus.stagers.hsdp_skip import ExecutorKind, SkipControl, split_copies
from dcp_plus.stagers.pool import SlabPool
from dcp_plus.stagers.stage_future import StageFuture
from dcp_plus.stagers.staged import StagedStateDict
from dcp_plus.stagers.tree import Captured, fill, fqns_of, local_tensor, rewrap

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """A ``stage()`` call waiting for the driver thread."""

    captured: Captured
    events: dict[int, Any]
    future: StageFuture[StagedStateDict]
    may_skip: bool
    executor: ExecutorKind
    checksums: bool = False
    """Checksum each tensor's bytes as they are copied (CPU byte copies)."""
    reading: bool = True
    """The copy may still read the live tensors (``synchronize_staging`` waits for it)."""


@dataclass(slots=True)
class CopyStats:
    """What the last completed snapshot did."""

    copied_bytes: int = 0
    skipped_bytes: int = 0
    copy_s: float = 0.0
    device_copy_s: float | None = None
    """GPU mode: the device -> device copy's time (``None``: the snapshot went to host)."""


@dataclass
class Snapshotter:
    """Runs :class:`Job` s for one stager (its lock ``cond``, arenas, pool, skip and holds)."""

    _cond: threading.Condition
    _arenas: ArenaSet
    _pool: SlabPool
    _skip: SkipControl
    _holds: Holds
    _engine: CopyEngine
    _device: DeviceCopyPolicy
    stats: CopyStats = field(default_factory=CopyStats)

    def run(self, job: Job) -> None:
        """Driver thread: pick the arena buffer, copy, resolve the future."""
        arena: Arena | None = None
        buf: Buffer | None = None
        go = job.future.go
        try:
            job.future.wait_for_go()
            cap = job.captured
            locals_ = [local_tensor(t) for t in cap.tensors]
            fqns = fqns_of(cap.skeleton)
            fp = fingerprint(fqns, locals_)
            with self._cond:
                arena, buf = self._arenas.take_buffer(fp, self._pool, self._holds.buffers)
                buf.consumer_saves = job.executor == "thread"
            if not buf.views_alias_slabs():
                logger.warning("ArenaStager: arena views were re-based by someone; rebuilding them")
                buf.make_views(arena.layout)
            # Ask even for a new structure (the first query starts the planner's recording),
            # but skip only when the structure is the previous snapshot's.
            skip = self._skip.query(fqns) if job.may_skip else frozenset()
            if arena is not self._arenas.last:
                skip = frozenset()
            self._arenas.last = arena
            views = buf.views
            t_copy = time.perf_counter()
            copy, stale, skipped = split_copies(fqns, locals_, views, arena.layout.extents, skip)
            mirror = self._mirror_for(arena)
            device_s: float | None = None
            digests: dict[tuple[int, int], str] = {}
            if mirror is None:
                digests = self._engine.copy(copy, job.events, hashed=job.checksums)
            else:
                device_s = self._copy_through(mirror, arena, buf, fqns, locals_, skip, job)
            if skip:
                stale_views.set(buf.key, stale)
            self.stats = CopyStats(arena.tensor_bytes - skipped, skipped,
                                   time.perf_counter() - t_copy, device_s)
            staged = StagedStateDict(
                fill(
                    cap.skeleton,
                    [rewrap(o, v) for o, v in zip(cap.tensors, views, strict=True)],
                ),
                owner=buf.key,
                on_pickle=functools.partial(self._holds.pickled, buf, buf.generation),
                digests=digests,
            )
            release = functools.partial(self._holds.release, arena, buf, buf.generation)
            weakref.finalize(staged, release)
            job.future.release.fn = release
            job.future.on_consumer(functools.partial(_set_consumer, buf))
            arena = buf = None  # ownership moved to the finalizer
            job.future.set_result(staged)
            del staged
        except BaseException as e:
            err = e if isinstance(e, DcpPlusError) else StagingError(f"staging failed: {e!r}")
            if err is not e:
                err.__cause__ = e
            with self._cond:
                if buf is not None:
                    stale_views.pop(buf.key)
                    buf.in_use = False
                    if arena is not None:
                        self._arenas.drop_if_idle(arena)
                self._holds.error = err
            self._holds.release_permit()
            job.future.set_exception(err)
        finally:
            job.captured = None  # type: ignore[assignment]
            job.future = None  # type: ignore[assignment]
            self._live_released(job)
            with self._cond:
                self._holds.pending -= 1
                self._holds.gates.discard(go)
                self._cond.notify_all()

    def _live_released(self, job: Job) -> None:
        """No live tensor of ``job`` is read any more: ``synchronize_staging`` may return."""
        if job.reading:
            job.reading = False
            with self._cond:
                self._holds.reading -= 1
                self._cond.notify_all()

    def _mirror_for(self, arena: Arena) -> Mirror | None:
        """The arena's device mirror if this snapshot goes through one (allocated on first
        use, dropped when device memory no longer allows it), else ``None``."""
        policy = self._device
        if policy.mode == "never" or arena.mirror_plan.nbytes == 0 or arena.mirror_failed:
            return None
        device = arena.cuda_device
        if device is None:
            policy.reason = "CUDA tensors on several devices: host copy"
            return None
        if not policy.choose(arena.mirror_plan, arena.mirror, device):
            freed = arena.drop_mirror()
            if freed is not None:
                policy.dropped(*freed)
            return None
        if arena.mirror is None:
            try:
                arena.mirror = self._engine.allocate_mirror(
                    arena.mirror_plan, device, arena.layout.extents, arena.on_device
                )
                policy.allocated(device)
            except torch.OutOfMemoryError as e:
                # not again for this structure: each failed try empties training's cache
                arena.mirror_failed = True
                policy.reason = f"cuda:{device}: no memory for the device mirror: host copy"
                logger.warning("ArenaStager: %s, from now on for this state-dict structure "
                               "(%s)", policy.reason, e)
                return None
        return arena.mirror

    def _copy_through(
        self, mirror: Mirror, arena: Arena, buf: Buffer, fqns: list[str],
        locals_: list[Any], skip: frozenset[str], job: Job,
    ) -> float:
        """GPU-mode copy; returns the device copy's seconds (CheckFreq's T_g)."""
        to_mirror, cpu = [], []
        for f, src, view, dev_view in zip(fqns, locals_, buf.views, mirror.views, strict=True):
            if f in skip:
                continue
            if dev_view is not None:
                to_mirror.append((src, dev_view))
            elif not src.is_cuda:  # (an empty CUDA tensor has nothing to copy)
                cpu.append((src, view))
        to_host = [(mirror.bytes_of(s, a, b), buf.bases[s][a:b])  # (source, destination)
                   for s, a, b in arena.mirror_plan.runs]
        device_s = 0.0

        def released(seconds: float) -> None:
            nonlocal device_s
            device_s = seconds
            self._live_released(job)

        self._engine.copy_through_mirror(mirror, to_mirror, cpu, to_host, job.events, released)
        return device_s


def _set_consumer(buf: Buffer, thread: threading.Thread) -> None:
    buf.consumer = thread
