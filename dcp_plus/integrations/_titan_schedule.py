"""Drive a ``dcp_plus.schedule`` interval policy from TorchTitan's training loop.

TorchTitan calls ``checkpointer.save(step)`` once per step, after that step's optimizer
update, and ``checkpointer.maybe_wait_for_staging()`` inside the next step, right before
``optimizer.step()``. :class:`LoopSchedule` turns those calls into the numbers an
:class:`~dcp_plus.schedule.IntervalPolicy` is fed, in the order
:class:`dcp_plus.manager.CheckpointManager` feeds it:

* ``tick(step)`` at the start of each ``save(step)``: the iteration since the previous tick
  (its wall time and the part of it checkpointing held the loop: ``save()`` blocking plus the
  staging wait before ``optimizer.step()``), then every policy-chosen save that has finished
  since, oldest first (``SaveStats``: blocking, waiting for the previous persist, exposed
  staging, staging time Tc = save start to complete snapshot, persist time Ts = snapshot to
  commit);
* ``decide(step)``: the policy's answer, logged;
* ``saved(step, ...)`` when ``save()`` returns, with the staging and upload futures;
* ``staging_waited(seconds)`` from ``maybe_wait_for_staging()``.

Torch-free and TorchTitan-free, so the decision logic is tested with a scripted clock
(``tests/integration/test_titan_schedule.py``). In a job only the deciding rank runs it; the
manager broadcasts the answer (see ``DcpPlusCheckpointManager``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from dcp_plus.schedule import IntervalPolicy, SaveStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """A policy-chosen save whose persist has not been reported to the policy yet."""

    step: int
    started_at: float
    """After waiting for the previous persist (``save()``'s own work starts here)."""
    waited_s: float
    blocking_s: float
    done: Future[Any] | None
    exposed_staging_s: float = 0.0
    staged_at: float | None = None
    done_at: float | None = None


class LoopSchedule:
    """Feeds ``policy`` the timings of TorchTitan's loop and asks it at every step.

    Args:
        policy: the interval policy (e.g. ``AdaptiveInterval(p=0.05)``).
        clock: seconds, monotonic (scripted in tests).
    """

    def __init__(self, policy: IntervalPolicy, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.policy = policy
        self.clock = clock
        self.chosen: list[int] = []
        """Steps the policy chose to checkpoint, in order."""
        self._last_tick: float | None = None
        self._exposed = 0.0
        self._pending: deque[_Pending] = deque()
        self._staging: _Pending | None = None
        self._k: int | None = None

    def tick(self, step: int) -> None:
        """``save(step)`` was entered: report the iteration that ended here, then the saves
        that have finished since the last tick."""
        now = self.clock()
        if self._last_tick is not None:
            self.policy.observe_iteration(now - self._last_tick, self._exposed)
        self._last_tick = now
        self._exposed = 0.0
        while self._pending and self._finished(self._pending[0], now):
            self.policy.observe_save(self._stats(self._pending.popleft()))

    def decide(self, step: int) -> bool:
        """Whether the policy checkpoints ``step`` (call once per step, after ``tick``)."""
        want = self.policy.should_save(step)
        k = getattr(self.policy, "k", None)
        if k != self._k:
            log.info("dcp_plus: adaptive interval: k=%s from step %d", k, step)
            self._k = k
        if want:
            self.chosen.append(step)
            log.info("dcp_plus: adaptive interval: checkpoint at step %d (%s)", step,
                     "profiling" if k is None else f"k={k}")
        return want

    def saved(self, step: int, *, blocking_s: float, waited_s: float,
              staged: Future[Any] | None, done: Future[Any] | None) -> None:
        """``save(step)`` returned after holding the loop ``blocking_s`` (of which
        ``waited_s`` waiting for the previous persist). ``staged``/``done``: the snapshot and
        persist futures of an async save; ``None`` for a synchronous one (finished)."""
        self._exposed += blocking_s
        self._staging = None
        if not self.chosen or self.chosen[-1] != step:
            return  # a forced save (first or last step): its cost counts, it is no sample
        now = self.clock()
        pending = _Pending(step, started_at=now - max(0.0, blocking_s - waited_s),
                           waited_s=waited_s, blocking_s=blocking_s, done=done)
        if staged is None:
            pending.staged_at = now
        else:
            staged.add_done_callback(lambda _: self._mark(pending, "staged_at"))
        if done is None:
            pending.done_at = now
        else:
            done.add_done_callback(lambda _: self._mark(pending, "done_at"))
        self._pending.append(pending)
        self._staging = pending

    def staging_waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` for the latest save's snapshot before
        ``optimizer.step()``."""
        self._exposed += seconds
        if self._staging is not None:
            self._staging.exposed_staging_s += seconds
            self._staging = None

    # -- internals --------------------------------------------------------------------------

    def _mark(self, pending: _Pending, attr: str) -> None:
        if getattr(pending, attr) is None:
            setattr(pending, attr, self.clock())

    @staticmethod
    def _finished(pending: _Pending, now: float) -> bool:
        if pending.done is not None and not pending.done.done():
            return False
        # the future's waiters can wake before its callbacks have run: stamp it now
        if pending.done_at is None:
            pending.done_at = now
        if pending.staged_at is None:
            pending.staged_at = pending.done_at
        return True

    @staticmethod
    def _stats(p: _Pending) -> SaveStats:
        assert p.staged_at is not None and p.done_at is not None
        ok = p.done is None or (not p.done.cancelled() and p.done.exception() is None)
        if not ok:
            log.warning("dcp_plus: adaptive interval: the checkpoint of step %d failed; the "
                        "policy is told so", p.step)
        return SaveStats(step=p.step, blocking_s=p.blocking_s, waited_s=p.waited_s,
                         exposed_staging_s=p.exposed_staging_s,
                         staging_s=max(0.0, p.staged_at - p.started_at),
                         persist_s=max(0.0, p.done_at - p.staged_at), ok=ok)
