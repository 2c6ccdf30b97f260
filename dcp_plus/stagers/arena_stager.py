"""``ArenaStager``: DCP's ``AsyncStager`` over reusable shared-memory arenas.

``stage()`` captures the state dict's structure, waits for a free buffer, and hands the copy to
the :class:`~dcp_plus.stagers.copy_engine.CopyEngine`; it returns a ``Future`` of the staged
dict within milliseconds. The buffer is handed back when DCP drops the staged dict at the end
of the save (a ``weakref.finalize``), so no extra call is needed with stock ``dcp.async_save``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from dcp_plus.errors import ClosedError, DcpPlusError, StagingError
from dcp_plus.memory.slabs import remove_orphans
from dcp_plus.stagers.arena import Arena, fingerprint
from dcp_plus.stagers.arenas import ArenaSet
from dcp_plus.stagers.copy_engine import CopyEngine
from dcp_plus.stagers.device_copy import DeviceCopy, DeviceCopyPolicy, DeviceCopyStatus
from dcp_plus.stagers.guard import GuardHandle, checkpoint_bytes, install_guard
from dcp_plus.stagers.holds import Holds
from dcp_plus.stagers.hsdp_skip import (
    ExecutorKind,
    SkipControl,
    WriteSetSource,
    check_executor,
)
from dcp_plus.stagers.pool import SlabPool
from dcp_plus.stagers.snapshot import Job, Snapshotter
from dcp_plus.stagers.stage_future import Release, StageFuture
from dcp_plus.stagers.staged import StagedStateDict
from dcp_plus.stagers.tree import capture, fqns_of, local_tensor

logger = logging.getLogger(__name__)

__all__ = ["ArenaStager", "DeviceCopy", "ExecutorKind", "WriteSetSource"]


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
        executor: who consumes the staged dicts (also settable as :attr:`executor`):

            * ``"thread"`` (default; DCP's THREAD executor): the thread that takes the
              staged dict from the future runs the save. Once that thread has exited, its
              buffer is reused even if the staged dict is still referenced (a failed save's
              exception holds it). A staged dict that gets pickled turns ``skip_unwritten``
              off for good, as ``"process"`` does.
            * ``"process"`` (``async_save(async_checkpointer_type=PROCESS)``): the dict is
              pickled into DCP's daemon; ``skip_unwritten`` is ignored (every tensor copied).
            * ``"other"``: your own consumer; a buffer is reused only once its staged dict
              is dropped.
        device_copy: GPU-mode snapshots of CUDA tensors (CheckFreq): ``"auto"`` (default)
            first copies them into a reusable device buffer when the device has room for it
            after training's peak, releases the guard when that copy is done, and copies to
            host memory in the background; ``"always"`` does so whenever the CUDA tensors are
            on one device; ``"never"`` copies straight to host memory. Costs one more copy of
            the CUDA tensors' bytes in device memory while in use (see ``docs/stager.md``).
        device_margin_bytes: device memory ``"auto"`` keeps free beyond training's peak and
            the device buffer (default: the larger of 1 GiB and 5 % of the device).

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
        executor: ExecutorKind = "thread",
        device_copy: DeviceCopy = "auto",
        device_margin_bytes: int | None = None,
    ) -> None:
        if buffers not in (1, 2):
            raise ValueError(f"ArenaStager(buffers=...) must be 1 or 2, got {buffers}")
        if slab_bytes < 4096:
            raise ValueError(f"slab_bytes must be at least 4096, got {slab_bytes}")
        self._executor = check_executor(executor)
        self._device = DeviceCopyPolicy(device_copy, device_margin_bytes)
        for name in remove_orphans():
            logger.warning("removed shared-memory slab %s left by a dead process", name)
        self.buffers = buffers
        self.wait_timeout_s = wait_timeout_s
        self._engine = CopyEngine(num_threads or min(2, os.cpu_count() or 1))
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._set = ArenaSet(slab_bytes, max_bytes)
        self._set.mirror_dropped = self._device.dropped
        self._pool = SlabPool()  # pre-faulted slabs for the first arena
        self._prefaulted: Future[None] | None = None  # the guard's pre-fault job, if any
        self._closed = False
        self._skip = SkipControl(lock)
        self._holds = Holds(self._cond, self._set, self._skip, buffers)
        self._last_release: Release | None = None
        self._snapshots = Snapshotter(
            self._cond, self._set, self._pool, self._skip, self._holds, self._engine,
            self._device,
        )
        if skip_unwritten is not None:
            self.skip_unwritten_by(skip_unwritten)

    @property
    def executor(self) -> ExecutorKind:
        """Who consumes the staged dicts (see the class docstring); applies from the next
        ``stage()``."""
        return self._executor

    @executor.setter
    def executor(self, kind: ExecutorKind) -> None:
        self._executor = check_executor(kind)

    @property
    def last_copied_bytes(self) -> int:
        """Tensor bytes the last completed snapshot copied."""
        return self._snapshots.stats.copied_bytes

    @property
    def last_skipped_bytes(self) -> int:
        """Tensor bytes the last completed snapshot skipped (``skip_unwritten``)."""
        return self._snapshots.stats.skipped_bytes

    @property
    def last_copy_s(self) -> float:
        """Seconds the last completed snapshot spent copying (the rest is bookkeeping)."""
        return self._snapshots.stats.copy_s

    @property
    def device_copy_status(self) -> DeviceCopyStatus:
        """GPU mode now: the mode, why the last snapshot did (not) use it, device bytes held."""
        with self._cond:
            held = sum(a.mirror.nbytes for a in self._arenas if a.mirror is not None)
        return DeviceCopyStatus(self._device.mode, self._device.reason, held,
                                self._snapshots.stats.device_copy_s)

    @property
    def max_bytes(self) -> int | None:
        """Upper bound on shared memory held by arenas; ``None`` for no bound."""
        return self._set.max_bytes

    @property
    def slab_bytes(self) -> int:
        """Target slab size."""
        return self._set.slab_bytes

    @property
    def _arenas(self) -> list[Arena]:
        return self._set.arenas

    # -- AsyncStager ----------------------------------------------------------------------

    def stage(self, state_dict: Mapping[str, Any], *, checksums: bool = False,  # type: ignore[override]
              **_: Any) -> Future[StagedStateDict]:
        """Snapshot ``state_dict``; returns a ``Future`` of the staged dict.

        Tensors are captured by reference now and copied in the background; non-tensor values
        are deep-copied now. The live tensors must not change until the future is done: use
        :meth:`guard` or wait on ``AsyncSaveResponse.staging_completion``. ``checksums``: also
        fill the staged dict's ``digests``, hashing each piece as it is copied.

        Raises:
            ClosedError: the stager was closed.
            StagingError: the state dict holds an unsupported value, or no buffer was freed
                within ``wait_timeout_s``.
        """
        self._check_open("stage")
        captured = capture(state_dict)
        devices = {t.device for t in captured.tensors if t.is_cuda}
        executor = self._executor
        may_skip = self._skip.armed(executor)
        self._holds.acquire(self.wait_timeout_s, lambda: self._check_open("stage"))
        try:
            events = self._engine.mark(devices) if devices else {}
            future: StageFuture[StagedStateDict] = StageFuture()
            job = Job(captured, events, future, may_skip, executor, checksums)
            with self._cond:
                self._holds.pending += 1
                self._holds.reading += 1
                self._holds.gates.add(future.go)
            self._engine.submit(lambda: self._snapshots.run(job))
        except BaseException:
            self._holds.release_permit()
            raise
        self._last_release = future.release  # the buffer's, not the staged dict's
        return future

    def release_when(self, done: Future[Any]) -> None:
        """The snapshot staged last is free once ``done`` completes.

        Pass the save's ``AsyncSaveResponse.upload_completion`` right after ``async_save``
        returns: its buffer is then reused as soon as the persist ends, even while the staged
        dict is still referenced (by a failed save's exception, or by the save's arguments
        while ``done``'s callbacks run, where a ``close()`` would otherwise wait for it).
        Without it, a buffer is free when its staged dict dies (or, ``executor="thread"``,
        when the thread that ran the save exits).
        """
        release = self._last_release
        if release is None:
            raise StagingError("ArenaStager.release_when(): nothing was staged yet")
        done.add_done_callback(lambda _: release())

    def synchronize_staging(self) -> None:
        """Wait until no snapshot submitted so far reads the live tensors any more.

        That is when every snapshot has been copied, or, in GPU mode (``device_copy``), once
        its device -> device copy is done (the copy to host then goes on in the background;
        the ``stage()`` future resolves after it).

        Raises:
            StagingError: a snapshot failed (raised once, then cleared).
        """
        holds = self._holds
        with self._cond:
            for go in holds.gates:
                go.set()
            while holds.reading:
                self._cond.wait()
            err, holds.error = holds.error, None
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
            for go in self._holds.gates:
                go.set()
            self._cond.notify_all()
        self._engine.close()
        # close() on the thread that consumed a snapshot (an upload future's done callback
        # runs there while the save's arguments still hold the staged dict): that save is
        # over, and waiting for its dict to die would wait forever
        me = threading.current_thread()
        self._holds.reclaim(lambda b: b.consumer is me, "close() runs on its consumer thread")
        if not self.wait_persisted(timeout):
            logger.warning(
                "ArenaStager.close(): %d snapshot(s) still referenced after %ss; freeing anyway",
                self._holds.held,
                timeout,
            )
        with self._cond:
            self._set.free_all()
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
            self._set.check_capacity(nbytes + self._pool.nbytes)
        return self._engine.submit(lambda: self._fill_pool(nbytes))

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until no staged dict is alive (every save has persisted and dropped it).

        Returns:
            False if ``timeout`` seconds passed first.
        """
        holds = self._holds
        return holds.wait(lambda: holds.held == 0 and holds.pending == 0, timeout)

    def reserve(self, state_dict: Mapping[str, Any]) -> None:
        """Allocate and pre-fault the arena for ``state_dict``'s structure now.

        Optional: call it at start-up so the first checkpoint copies at memory speed instead
        of paying the kernel's first-touch cost.
        """
        self._check_open("reserve")
        cap = capture(state_dict)
        fp = fingerprint(fqns_of(cap.skeleton), [local_tensor(t) for t in cap.tensors])
        with self._cond:
            arena = self._set.arena_for(fp)
            while len(arena.buffers) < self.buffers:
                self._set.check_capacity(arena.layout.nbytes)
                arena.add_buffer()
            bufs = list(arena.buffers)
        for buf in bufs:
            buf.prefault()

    def _fill_pool(self, nbytes: int) -> None:
        with self._cond:
            if self._closed or self._arenas:
                return
        self._pool.prefill(nbytes, self.slab_bytes)

    def skip_unwritten_by(self, planner: WriteSetSource | None) -> None:
        """Skip copying the tensors ``planner``'s last save on this rank did not write.

        See ``skip_unwritten`` in the class docstring; ``None`` turns skipping off. Calling it
        again also re-arms skipping after the stager turned it off (see :attr:`skip_off`).
        """
        self._skip.bind(planner)

    @property
    def skip_off(self) -> str | None:
        """Why ``skip_unwritten`` stopped skipping for good, or None while it is armed."""
        return self._skip.off

    def slab_names(self) -> list[str]:
        """Names of every slab this stager currently holds."""
        with self._cond:
            return self._set.names()

    @property
    def nbytes(self) -> int:
        """Shared-memory bytes currently held by arenas (and pre-faulted, not yet used)."""
        with self._cond:
            return self._set.nbytes + self._pool.nbytes

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
