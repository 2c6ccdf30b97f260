"""``ArenaStager``: DCP's ``AsyncStager`` over reusable shared-memory arenas.

``stage()`` captures the state dict's structure, waits for a free buffer, and hands the copy to
the :class:`~dcp_plus.stagers.copy_engine.CopyEngine`; it returns a ``Future`` of the staged
dict within milliseconds. The buffer is handed back when DCP drops the staged dict at the end
of the save (a ``weakref.finalize``), so no extra call is needed with stock ``dcp.async_save``.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from dcp_plus.errors import CapacityError, ClosedError, DcpPlusError, StagingError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.memory.slabs import remove_orphans
from dcp_plus.stagers.arena import Arena, Buffer, Fingerprint, plan_layout, slab_names
from dcp_plus.stagers.copy_engine import CopyEngine
from dcp_plus.stagers.guard import GuardHandle, checkpoint_bytes, install_guard
from dcp_plus.stagers.pool import SlabPool
from dcp_plus.stagers.stage_future import StageFuture
from dcp_plus.stagers.staged import StagedStateDict
from dcp_plus.stagers.tree import Captured, capture, fill, fqns_of, local_tensor, rewrap

logger = logging.getLogger(__name__)

_GC_AFTER_S = 1.0
"""Waiting this long for a buffer runs one ``gc.collect()`` (a cycle may hold a staged dict)."""
_WARN_EVERY_S = 60.0
_SAVE_THREAD_PREFIX = "AsyncCheckpointExecutor"
"""Name prefix of the per-save thread ``dcp.async_save`` (THREAD executor) runs a save on."""
_SAVER_MODULE = "torch.distributed.checkpoint.state_dict_saver"


class WriteSetSource(Protocol):
    """What ``skip_unwritten`` needs: a ``CachedSavePlanner`` (see ``docs/planner.md``)."""

    def unwritten_tensor_fqns(self, fqns: Sequence[str]) -> frozenset[str]: ...


@dataclass(slots=True)
class _Job:
    captured: Captured
    events: dict[int, Any]
    future: StageFuture[StagedStateDict]
    may_skip: bool = False


class ArenaStager(AsyncStager):
    """Stages state dicts into reusable shared-memory arenas (see ``docs/stager.md``).

    Args:
        buffers: 1 (default): ``stage()`` first waits until the previous snapshot has been
            persisted, and one arena buffer is reused. 2: a new snapshot may be taken while
            the previous one persists (twice the memory).
        max_bytes: upper bound on shared memory held by arenas; ``None`` for no bound.
        num_threads: CPU copy threads (including the driver thread).
        slab_bytes: target slab size; a tensor larger than this gets its own slab.
        wait_timeout_s: how long ``stage()`` waits for a buffer before raising
            :class:`~dcp_plus.errors.StagingError`; ``None`` waits forever.
        skip_unwritten: a :class:`~dcp_plus.planners.CachedSavePlanner` (the one every save
            of this stager's snapshots uses). When its last save plan on this rank did not
            write some tensors (HSDP: another replica writes them) and the structure is the
            same, the snapshot does not copy them; the planner fails a save that would write
            one (see ``docs/stager.md``, "HSDP staging skip"). THREAD executor only.

    The staged dict a ``stage()`` future resolves to is valid until its save has persisted:
    afterwards its memory is reused by a later snapshot.
    """

    _synchronize_after_execute: bool = False

    def __init__(
        self,
        *,
        buffers: int = 1,
        max_bytes: int | None = None,
        num_threads: int | None = None,
        slab_bytes: int = 512 << 20,
        wait_timeout_s: float | None = None,
        skip_unwritten: WriteSetSource | None = None,
    ) -> None:
        if buffers not in (1, 2):
            raise ValueError(f"ArenaStager(buffers=...) must be 1 or 2, got {buffers}")
        if slab_bytes < 4096:
            raise ValueError(f"slab_bytes must be at least 4096, got {slab_bytes}")
        for name in remove_orphans():
            logger.warning("removed shared-memory slab %s left by a dead process", name)
        self.buffers = buffers
        self.max_bytes = max_bytes
        self.slab_bytes = slab_bytes
        self.wait_timeout_s = wait_timeout_s
        self._engine = CopyEngine(num_threads or min(2, os.cpu_count() or 1))
        self._cond = threading.Condition(threading.RLock())
        self._arenas: list[Arena] = []
        self._current: Arena | None = None
        self._held = 0  # snapshots staged or being staged and not yet persisted
        self._pending = 0  # jobs submitted and not finished
        self._gates: set[threading.Event] = set()  # start signals of those jobs
        self._pool = SlabPool()  # pre-faulted slabs for the first arena
        self._prefaulted: Future[None] | None = None  # the guard's pre-fault job, if any
        self._error: BaseException | None = None
        self._closed = False
        self._skip: WriteSetSource | None = None
        self._skip_off: str | None = None  # why skipping stopped for good (until re-bound)
        self._skip_pause = False  # the last checked save failed: copy all in the next one
        self._warned_process = False
        self._last_arena: Arena | None = None  # driver thread only
        self.last_copied_bytes = 0
        """Tensor bytes the last completed snapshot copied."""
        self.last_skipped_bytes = 0
        """Tensor bytes the last completed snapshot skipped (``skip_unwritten``)."""
        self.last_copy_s = 0.0
        """Seconds the last completed snapshot spent copying (the rest is bookkeeping)."""
        if skip_unwritten is not None:
            self.skip_unwritten_by(skip_unwritten)

    # -- AsyncStager ----------------------------------------------------------------------

    def stage(self, state_dict: Mapping[str, Any], **_: Any) -> Future[StagedStateDict]:  # type: ignore[override]
        """Snapshot ``state_dict``; returns a ``Future`` of the staged dict.

        Tensors are captured by reference now and copied in the background; non-tensor values
        are deep-copied now. The live tensors must not change until the future is done: use
        :meth:`guard` or wait on ``AsyncSaveResponse.staging_completion``.

        Raises:
            ClosedError: the stager was closed.
            StagingError: the state dict holds an unsupported value, or no buffer was freed
                within ``wait_timeout_s``.
        """
        self._check_open("stage")
        captured = capture(state_dict)
        devices = {t.device for t in captured.tensors if t.is_cuda}
        may_skip = self._skip is not None and self._skip_off is None and self._thread_executor()
        self._acquire()
        try:
            events = self._engine.mark(devices) if devices else {}
            future: StageFuture[StagedStateDict] = StageFuture()
            job = _Job(captured, events, future, may_skip)
            with self._cond:
                self._pending += 1
                self._gates.add(future.go)
            self._engine.submit(lambda: self._run(job))
        except BaseException:
            self._release_permit()
            raise
        return future

    def synchronize_staging(self) -> None:
        """Wait until every snapshot submitted so far has been copied.

        Raises:
            StagingError: a snapshot failed (raised once, then cleared).
        """
        with self._cond:
            for go in self._gates:
                go.set()
            while self._pending:
                self._cond.wait()
            err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self, timeout: float | None = None) -> None:
        """Wait for staging and persists, then unlink every slab and join every thread.

        Args:
            timeout: longest wait for in-flight persists; after it, slabs are unlinked anyway
                (views still alive keep their mapping, so nothing reads freed memory).
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for go in self._gates:
                go.set()
            self._cond.notify_all()
        self._engine.close()
        # close() on the thread that consumed a snapshot (an upload future's done callback
        # runs there while the save's arguments still hold the staged dict): that save is
        # over, and waiting for its dict to die would wait forever
        me = threading.current_thread()
        self._reclaim(lambda t: t is me, "close() runs on its thread {name}", logging.INFO)
        if not self.wait_persisted(timeout):
            logger.warning(
                "ArenaStager.close(): %d snapshot(s) still referenced after %ss; freeing anyway",
                self._held,
                timeout,
            )
        with self._cond:
            for arena in self._arenas:
                for buf in arena.buffers:
                    buf.in_use = False
                    stale_views.pop(buf.key)
                arena.free()
            self._last_arena = None
            self._arenas = []
            self._current = None
        self._pool.drain()

    # -- extras ---------------------------------------------------------------------------

    def guard(
        self,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        *,
        prefault: bool = True,
    ) -> GuardHandle:
        """Make every ``optimizer.step()`` first wait for the snapshot in flight.

        Args:
            optimizers: one optimizer or several.
            prefault: after the first step, fault in (on a background thread) as much shared
                memory as parameters plus optimizer state take, so the first checkpoint
                copies at memory speed (see :meth:`prefault`).

        Returns:
            A handle whose ``remove()`` uninstalls the hooks.
        """
        self._check_open("guard")

        def after_first_step(opts: list[torch.optim.Optimizer]) -> None:
            with self._cond:
                if self._closed or self._arenas:
                    return
            try:
                self._prefaulted = self.prefault(checkpoint_bytes(opts))
            except DcpPlusError as e:  # e.g. over max_bytes: the first save will say so too
                logger.warning("ArenaStager: no pre-fault after the first step: %s", e)

        return install_guard(
            optimizers, self.synchronize_staging, after_first_step if prefault else None
        )

    def prefault(self, nbytes: int) -> Future[None]:
        """Fault in ``nbytes`` of shared memory on the copy thread for the first snapshot.

        The first arena takes its slabs from these (shrunk to fit; what is left over is
        freed), so the first checkpoint copies at memory speed instead of paying the kernel's
        first-touch cost. :meth:`guard` calls this after the first optimizer step; call it
        yourself when staging without a guard. A later snapshot that finds the arena built
        ignores the pool.

        Returns:
            A future that is done when the memory is faulted in.
        """
        self._check_open("prefault")
        with self._cond:
            self._check_capacity(nbytes + self._pool.nbytes)
        return self._engine.submit(lambda: self._fill_pool(nbytes))

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until no staged dict is alive (every save has persisted and dropped it).

        Returns:
            False if ``timeout`` seconds passed first.
        """
        return self._wait_until(
            lambda: self._held == 0 and self._pending == 0, timeout, self._reclaim_ended_saves
        )

    def reserve(self, state_dict: Mapping[str, Any]) -> None:
        """Allocate and pre-fault the arena for ``state_dict``'s structure now.

        Optional: call it at start-up so the first checkpoint copies at memory speed instead
        of paying the kernel's first-touch cost.
        """
        self._check_open("reserve")
        cap = capture(state_dict)
        fp = _fingerprint(fqns_of(cap.skeleton), [local_tensor(t) for t in cap.tensors])
        with self._cond:
            arena = self._arena_for(fp)
            while len(arena.buffers) < self.buffers:
                self._check_capacity(arena.layout.nbytes)
                arena.add_buffer()
            bufs = list(arena.buffers)
        for buf in bufs:
            buf.prefault()

    def _fill_pool(self, nbytes: int) -> None:
        with self._cond:
            if self._closed or self._arenas:
                return
        t0 = time.perf_counter()
        try:
            self._pool.fill(nbytes, self.slab_bytes)
        except OSError as e:
            logger.warning("ArenaStager: pre-faulting %d bytes failed: %s", nbytes, e)
            self._pool.drain()
            return
        logger.info(
            "ArenaStager: pre-faulted %.1f MB in %.2fs", nbytes / 1e6, time.perf_counter() - t0
        )

    def skip_unwritten_by(self, planner: WriteSetSource | None) -> None:
        """Skip copying the tensors ``planner``'s last save on this rank did not write.

        See ``skip_unwritten`` in the class docstring; ``None`` turns skipping off. Calling it
        again also re-arms skipping after the stager turned it off (see :attr:`skip_off`).
        """
        if planner is not None and not callable(getattr(planner, "unwritten_tensor_fqns", None)):
            raise TypeError(
                "skip_unwritten needs a CachedSavePlanner (an object with "
                f"unwritten_tensor_fqns()), got {type(planner).__name__}"
            )
        with self._cond:
            self._skip = planner
            self._skip_off = None
            self._skip_pause = False

    @property
    def skip_off(self) -> str | None:
        """Why ``skip_unwritten`` stopped skipping for good, or None while it is armed."""
        return self._skip_off

    def slab_names(self) -> list[str]:
        """Names of every slab this stager currently holds."""
        with self._cond:
            return slab_names(self._arenas)

    @property
    def nbytes(self) -> int:
        """Shared-memory bytes currently held by arenas (and pre-faulted, not yet used)."""
        with self._cond:
            return sum(a.nbytes for a in self._arenas) + self._pool.nbytes

    def __enter__(self) -> ArenaStager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(
                f"ArenaStager.{what}() called after close(); create a new ArenaStager"
            )

    def _wait_until(
        self, pred: Any, timeout: float | None, after_gc: Any = None
    ) -> bool:
        start = time.monotonic()
        collected = False
        next_warn = _WARN_EVERY_S
        with self._cond:
            while not pred():
                waited = time.monotonic() - start
                if timeout is not None and waited >= timeout:
                    return False
                if waited >= _GC_AFTER_S and not collected:
                    collected = True
                    gc.collect()
                    if after_gc is not None:
                        after_gc()
                    continue
                if waited >= next_warn:
                    next_warn += _WARN_EVERY_S
                    logger.warning(
                        "ArenaStager: waited %.0fs for %d staged dict(s) to be released; a "
                        "reference outlives its save (see docs/stager.md, 'buffer release')",
                        waited,
                        self._held,
                    )
                step = _GC_AFTER_S if not collected else 5.0
                if timeout is not None:
                    step = min(step, timeout - waited)
                self._cond.wait(max(step, 0.001))
        return True

    def _acquire(self) -> None:
        def free() -> bool:
            if self._closed:
                raise ClosedError(
                    "ArenaStager.stage() called after close(); create a new ArenaStager"
                )
            return self._held < self.buffers

        if not self._wait_until(free, self.wait_timeout_s, self._reclaim_ended_saves):
            raise StagingError(
                f"ArenaStager(buffers={self.buffers}): no buffer was released within "
                f"{self.wait_timeout_s}s; the previous save has not finished or a staged dict is "
                "still referenced (drop it, or raise wait_timeout_s)"
            )
        with self._cond:
            self._held += 1

    def _release_permit(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    def _reclaim_ended_saves(self) -> None:
        """Free buffers whose save has ended although their staged dict is still referenced.

        A failed save keeps its staged dict alive through the exception's traceback (stored in
        the ``upload_completion`` future until the caller drops it). With ``buffers=1`` the
        next ``stage()`` would wait for it forever. The save ran on the thread that consumed
        the stage future (``async_save``'s per-save executor thread, which exits after the
        save): once that thread is gone, nothing will read the buffer any more, so it is
        reused. Other consumers (a user's thread, the PROCESS executor) are never presumed
        done.
        """
        self._reclaim(lambda t: t.name.startswith(_SAVE_THREAD_PREFIX) and not t.is_alive(),
                      "its thread {name} exited", logging.WARNING)

    def _reclaim(self, ended: Any, why: str, level: int) -> None:
        """Free every in-use buffer whose consumer thread ``ended(thread)`` says is done."""
        with self._cond:
            for arena in self._arenas:
                for buf in arena.buffers:
                    t = buf.consumer
                    if buf.in_use and t is not None and ended(t):
                        logger.log(
                            level, "ArenaStager: the save that used a snapshot ended (%s) but its "
                            "staged dict is still referenced, usually by a failed save's "
                            "exception or the save's own arguments; reusing its buffer",
                            why.format(name=t.name),
                        )
                        buf.generation += 1  # the old dict's finalizer no longer counts
                        buf.consumer = None
                        if stale_views.pop(buf.key) is not None:
                            self._skip_pause = True  # its plan never vouched: copy all next
                        buf.in_use = False
                        self._held -= 1
            self._cond.notify_all()

    def _release(self, arena: Arena, buf: Buffer, generation: int) -> None:
        """Finalizer of a staged dict: its save is over, the buffer is free again."""
        with self._cond:
            if buf.generation != generation:  # reclaimed earlier (see _reclaim_ended_saves)
                return
            buf.generation += 1
            buf.consumer = None
            entry = stale_views.pop(buf.key)
            if entry is not None:
                if entry.failed:
                    self._skip_pause = True
                elif not entry.checked:
                    self._skip_off = (
                        f"a snapshot with {len(entry.views)} skipped tensor(s) was released "
                        "without a CachedSavePlanner checking its save plan: its save failed "
                        "before planning finished, or it was saved with another planner (which "
                        "would have written the skipped tensors' stale bytes)"
                    )
                    logger.error(
                        "ArenaStager(skip_unwritten=...): %s; skipping is off for this stager "
                        "(call skip_unwritten_by() to re-arm it)",
                        self._skip_off,
                    )
            buf.in_use = False
            self._held -= 1
            if arena.retired and not arena.in_use():
                self._drop_arena(arena)
            self._cond.notify_all()

    def _drop_arena(self, arena: Arena) -> None:
        for buf in arena.buffers:
            stale_views.pop(buf.key)
        if self._last_arena is arena:
            self._last_arena = None
        arena.free()
        self._arenas = [a for a in self._arenas if a is not arena]

    def _check_capacity(self, extra: int) -> None:
        if self.max_bytes is None:
            return
        held = sum(a.nbytes for a in self._arenas)
        if held + extra > self.max_bytes:
            raise CapacityError(
                f"ArenaStager: staging needs {extra} more bytes of shared memory ({held} held) "
                f"but max_bytes={self.max_bytes}; raise max_bytes, use buffers=1, or stage a "
                "smaller state dict"
            )

    def _arena_for(self, fp: Fingerprint) -> Arena:
        cur = self._current
        if cur is not None and cur.fingerprint == fp:
            return cur
        if cur is not None:
            logger.info("ArenaStager: state-dict structure changed; allocating a new arena")
            cur.retired = True
            if not cur.in_use():
                self._drop_arena(cur)
        pin = any(dev != "cpu" for *_, dev in fp) and torch.cuda.is_available()
        arena = Arena(fp, plan_layout(fp, self.slab_bytes), pin=pin)
        self._arenas = [*self._arenas, arena]
        self._current = arena
        return arena

    def _take_buffer(self, fp: Fingerprint) -> tuple[Arena, Buffer]:
        with self._cond:
            arena = self._arena_for(fp)
            buf = arena.free_buffer()
            if buf is None:
                self._check_capacity(arena.layout.nbytes)
                buf = arena.add_buffer(self._pool)
                self._pool.drain()
            buf.in_use = True
            return arena, buf

    def _run(self, job: _Job) -> None:
        """Driver thread: pick the arena buffer, copy, resolve the future."""
        arena: Arena | None = None
        buf: Buffer | None = None
        go = job.future.go
        try:
            job.future.wait_for_go()
            cap = job.captured
            locals_ = [local_tensor(t) for t in cap.tensors]
            fqns = fqns_of(cap.skeleton)
            fp = _fingerprint(fqns, locals_)
            arena, buf = self._take_buffer(fp)
            if not buf.views_alias_slabs():
                logger.warning("ArenaStager: arena views were re-based by someone; rebuilding them")
                buf.make_views(arena.layout)
            # Ask even for a new structure (the first query starts the planner's recording),
            # but skip only when the structure is the previous snapshot's.
            skip = self._skip_set(fqns) if job.may_skip else frozenset()
            if arena is not self._last_arena:
                skip = frozenset()
            self._last_arena = arena
            views = buf.views
            t_copy = time.perf_counter()
            if skip:
                extents = arena.layout.extents
                copy, stale, skipped = [], {}, 0
                for i, f in enumerate(fqns):
                    if f in skip:
                        nbytes = extents[i].nbytes
                        if nbytes:
                            stale[views[i].data_ptr()] = f
                            skipped += nbytes
                    else:
                        copy.append((locals_[i], views[i]))
                self._engine.copy(copy, job.events)
                stale_views.set(buf.key, stale)
            else:
                self._engine.copy(list(zip(locals_, views, strict=True)), job.events)
                skipped = 0
            self.last_copy_s = time.perf_counter() - t_copy
            self.last_copied_bytes = arena.tensor_bytes - skipped
            self.last_skipped_bytes = skipped
            staged = StagedStateDict(
                fill(
                    cap.skeleton,
                    [rewrap(o, v) for o, v in zip(cap.tensors, views, strict=True)],
                ),
                owner=buf.key,
            )
            weakref.finalize(staged, self._release, arena, buf, buf.generation)
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
                    if arena is not None and arena.retired and not arena.in_use():
                        self._drop_arena(arena)
                self._error = err
            self._release_permit()
            job.future.set_exception(err)
        finally:
            job.captured = None  # type: ignore[assignment]
            job.future = None  # type: ignore[assignment]
            with self._cond:
                self._pending -= 1
                self._gates.discard(go)
                self._cond.notify_all()

    def _skip_set(self, fqns: list[str]) -> frozenset[str]:
        """Driver thread: the fqns this snapshot may leave out (empty: copy everything)."""
        with self._cond:
            planner, off = self._skip, self._skip_off
            if self._skip_pause:
                self._skip_pause = False
                return frozenset()
        if planner is None or off is not None:
            return frozenset()
        try:
            return planner.unwritten_tensor_fqns(fqns)
        except Exception:
            logger.exception("ArenaStager: skip_unwritten query failed; copying every tensor")
            return frozenset()

    def _thread_executor(self) -> bool:
        """False when ``stage()`` is called by ``async_save`` with the PROCESS executor."""
        try:
            f: FrameType | None = sys._getframe(2)
        except ValueError:  # called from the top of a stack: not from async_save
            return True
        for _ in range(8):
            if f is None:
                break
            if f.f_code.co_name == "async_save" and f.f_globals.get("__name__") == _SAVER_MODULE:
                kind = f.f_locals.get("async_checkpointer_type")
                if getattr(kind, "name", None) != "PROCESS":
                    return True
                if not self._warned_process:
                    self._warned_process = True
                    logger.warning(
                        "ArenaStager(skip_unwritten=...) is ignored with DCP's PROCESS "
                        "executor (the planner runs in its daemon): every tensor is copied"
                    )
                return False
            f = f.f_back
        return True


def _set_consumer(buf: Buffer, thread: threading.Thread) -> None:
    buf.consumer = thread


def _fingerprint(fqns: list[str], tensors: list[torch.Tensor]) -> Fingerprint:
    return tuple(
        (f, t.dtype, tuple(t.shape), t.stride(), str(t.device))
        for f, t in zip(fqns, tensors, strict=True)
    )
