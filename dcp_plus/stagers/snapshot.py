"""One snapshot on the copy engine's driver thread: take a buffer, copy, resolve the future."""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from dcp_plus.errors import DcpPlusError, StagingError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.stagers.arena import Arena, Buffer, fingerprint
from dcp_plus.stagers.arenas import ArenaSet
from dcp_plus.stagers.copy_engine import CopyEngine
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


@dataclass(slots=True)
class CopyStats:
    """What the last completed snapshot did."""

    copied_bytes: int = 0
    skipped_bytes: int = 0
    copy_s: float = 0.0


@dataclass
class Snapshotter:
    """Runs :class:`Job` s for one stager (its lock ``cond``, arenas, pool, skip and holds)."""

    _cond: threading.Condition
    _arenas: ArenaSet
    _pool: SlabPool
    _skip: SkipControl
    _holds: Holds
    _engine: CopyEngine
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
                arena, buf = self._arenas.take_buffer(fp, self._pool)
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
            self._engine.copy(copy, job.events)
            if skip:
                stale_views.set(buf.key, stale)
            self.stats = CopyStats(arena.tensor_bytes - skipped, skipped,
                                   time.perf_counter() - t_copy)
            staged = StagedStateDict(
                fill(
                    cap.skeleton,
                    [rewrap(o, v) for o, v in zip(cap.tensors, views, strict=True)],
                ),
                owner=buf.key,
                on_pickle=functools.partial(self._holds.pickled, buf, buf.generation),
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
            with self._cond:
                self._holds.pending -= 1
                self._holds.gates.discard(go)
                self._cond.notify_all()


def _set_consumer(buf: Buffer, thread: threading.Thread) -> None:
    buf.consumer = thread
