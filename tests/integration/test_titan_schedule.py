"""The TorchTitan manager's adaptive-interval decisions on a scripted clock.

``LoopSchedule`` is what ``DcpPlusCheckpointManager`` runs on rank 0 when
``checkpoint.adaptive_budget`` is set. Here a scripted loop replays TorchTitan's call order
(``save(step)`` after each step, ``maybe_wait_for_staging()`` before the next
``optimizer.step()``, a save that falls due while the previous persist runs waits for it), with
snapshot and persist futures completing at scripted times. Torch-free: runs without TorchTitan.
"""

from __future__ import annotations

import heapq
import itertools
import math
from concurrent.futures import Future
from typing import Any

import pytest

from dcp_plus.integrations._titan_schedule import LoopSchedule
from dcp_plus.schedule import AdaptiveInterval, SaveStats

COMPUTE_S = 0.100  # forward/backward/optimizer of one step
BLOCK_S = 0.010    # save() holding the loop (flatten, stage submission, plan)
STAGE_S = 0.020    # save start -> complete snapshot (Tc)


class ScriptedLoop:
    """TorchTitan's loop driving a LoopSchedule; futures complete at scripted times."""

    def __init__(self, policy: Any, *, persist_s: float = 0.250) -> None:
        self.now = 0.0
        self.persist_s = persist_s
        self.sched = LoopSchedule(policy, clock=lambda: self.now)
        self._events: list[tuple[float, int, Future[Any], BaseException | None]] = []
        self._seq = itertools.count()
        self._staged: Future[Any] | None = None
        self._done: Future[Any] | None = None
        self.step = 0
        self.saved: list[int] = []
        self.waited: dict[int, float] = {}
        self.k_at: dict[int, int | None] = {}

    def _at(self, t: float, fut: Future[Any], error: BaseException | None = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fut, error))

    def advance(self, dt: float) -> None:
        self.run_until(self.now + dt)

    def run_until(self, t: float) -> None:
        while self._events and self._events[0][0] <= t:
            when, _, fut, error = heapq.heappop(self._events)
            self.now = when
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
        self.now = max(self.now, t)

    def _wait(self, fut: Future[Any]) -> float:
        begin = self.now
        while not fut.done():
            self.run_until(self._events[0][0])
        return self.now - begin

    def train_step(self) -> None:
        self.step += 1
        self.advance(COMPUTE_S - 0.001)
        if self._staged is not None:  # maybe_wait_for_staging() before optimizer.step()
            self.sched.staging_waited(self._wait(self._staged))
            self._staged = None
        self.advance(0.001)

    def save(self, *, forced: bool = False, fail: bool = False) -> bool:
        """``checkpointer.save(step)``: tick, decide, and (if due) wait + stage + submit."""
        self.sched.tick(self.step)
        self.k_at[self.step] = getattr(self.sched.policy, "k", None)
        if not forced and not self.sched.decide(self.step):
            return False
        waited = self._wait(self._done) if self._done is not None else 0.0
        self.waited[self.step] = waited
        start = self.now
        staged, done = Future[Any](), Future[Any]()
        self._at(start + STAGE_S, staged)
        self._at(start + STAGE_S + self.persist_s, done,
                 OSError("disk full") if fail else None)
        self.advance(BLOCK_S)
        self.sched.saved(self.step, blocking_s=waited + BLOCK_S, waited_s=waited,
                         staged=staged, done=done)
        self._staged, self._done = staged, done
        self.saved.append(self.step)
        return True

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.train_step()
            self.save()


class Recording(AdaptiveInterval):
    """AdaptiveInterval that keeps what it was fed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fed: list[SaveStats] = []

    def observe_save(self, stats: SaveStats) -> None:
        self.fed.append(stats)
        super().observe_save(stats)


def expected_k(p: float, ti: float, tc: float, ts: float, to: float) -> int:
    return max(1, math.ceil((tc + ts - to) / ti), math.ceil(to / (p * ti)))


def test_profiles_then_checkpoints_every_k_steps_from_the_measured_times() -> None:
    policy = Recording(0.05, warmup=2)
    loop = ScriptedLoop(policy, persist_s=0.250)
    loop.run(18)
    # Ti = 100 ms, Tc = 20 ms, Ts = 250 ms, To = 10 ms (blocking, no staging wait):
    # k = max(ceil((20 + 250 - 10) / 100), ceil(10 / (0.05 * 100))) = max(3, 2) = 3
    k = expected_k(0.05, COMPUTE_S, STAGE_S, 0.250, BLOCK_S)
    assert k == 3
    assert policy.k == k
    # profiling: after 2 measured iterations (step 3), then as soon as that persist is
    # reported (step 6: it ends 280 ms after step 3's save); then every k steps
    assert loop.saved == [3, 6, 9, 12, 15, 18]
    assert loop.sched.chosen == loop.saved
    assert [d.reason for d in policy.decisions] == ["profiled"]
    first = policy.fed[0]
    assert first.step == 3 and first.ok
    assert first.blocking_s == pytest.approx(BLOCK_S)
    assert first.waited_s == 0.0 and first.exposed_staging_s == 0.0
    assert first.staging_s == pytest.approx(STAGE_S)
    assert first.persist_s == pytest.approx(0.250)
    assert policy.ti.value == pytest.approx(COMPUTE_S)


def test_slower_storage_makes_saves_wait_and_raises_k_then_gaps_follow_it() -> None:
    policy = Recording(0.05, warmup=2)
    loop = ScriptedLoop(policy, persist_s=0.250)
    loop.run(12)
    assert policy.k == 3 and loop.saved[-1] == 12
    loop.persist_s = 0.900  # storage slows down: a persist now outlasts k steps
    loop.run(60)
    # step 18's save had to wait for step 15's (slow) persist, and that wait was exposed
    assert loop.waited[15] == 0.0 and loop.waited[18] > 0.5
    assert any(s.waited_s > 0.5 for s in policy.fed)
    raised = [d for d in policy.decisions if d.reason == "overhead above p"]
    assert raised and raised[0].k > 3 and policy.k == raised[-1].k
    # k ends near (Tc + Ts - To) / Ti = 9.1: a save then barely waits for the previous one
    assert policy.k is not None and policy.k >= 9
    gaps = [b - a for a, b in zip(loop.saved[-4:-1], loop.saved[-3:], strict=True)]
    assert gaps == [policy.k] * 3
    assert all(loop.waited[s] < 0.05 for s in loop.saved[-3:])


def test_every_step_the_policy_was_asked_matches_its_interval() -> None:
    """Replay: a step is checkpointed iff it is k (the k in force then) past the last one."""
    policy = AdaptiveInterval(0.05, warmup=2)
    loop = ScriptedLoop(policy, persist_s=0.250)
    loop.run(30)
    in_force = loop.k_at
    tuned = [s for s in loop.saved if in_force[s] is not None]
    assert len(tuned) >= 5
    last = loop.saved[loop.saved.index(tuned[0]) - 1]
    for step in range(last + 1, 31):
        k = in_force[step]
        if k is None:  # profiled, not tuned yet (the last profiling persist is running)
            assert step not in loop.saved
            continue
        assert (step in loop.saved) == (step - last >= k), (step, last, k)
        if step in loop.saved:
            last = step


def test_forced_saves_cost_time_but_are_not_policy_samples() -> None:
    policy = Recording(0.05, warmup=2)
    loop = ScriptedLoop(policy)
    loop.train_step()
    assert loop.save(forced=True)  # enable_first_step_checkpoint
    loop.run(2)
    assert loop.sched.chosen == [3]  # step 1 was not the policy's
    assert policy.fed == []  # the forced save is not reported as a profiling sample
    # its blocking time was exposed in the iteration it ended: Ti excludes it
    assert policy.ti.value == pytest.approx(COMPUTE_S)
    assert policy.meter.checkpoint_s == pytest.approx(BLOCK_S)


def test_a_failed_persist_is_reported_as_failed_and_profiling_retries() -> None:
    policy = Recording(0.05, warmup=2)
    loop = ScriptedLoop(policy)
    loop.run(2)
    loop.train_step()
    assert loop.save(fail=True)  # step 3: the persist will fail
    loop.run(10)
    assert policy.fed[0].step == 3 and not policy.fed[0].ok
    # a failed checkpoint is no sample: two good ones are still needed before tuning
    assert [s.ok for s in policy.fed[:3]] == [False, True, True]
    assert policy.decisions and policy.decisions[0].reason == "profiled"


def test_decisions_and_checkpoints_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="dcp_plus")
    loop = ScriptedLoop(AdaptiveInterval(0.05, warmup=2))
    loop.run(12)
    text = caplog.text
    assert "adaptive interval: checkpoint at step 3 (profiling)" in text
    assert "adaptive interval: k=3 from step 9" in text
    assert "adaptive interval: checkpoint at step 9 (k=3)" in text


def test_a_synchronous_save_is_all_staging_and_reported_at_the_next_step() -> None:
    """async_mode="disabled": save() writes everything before returning (no futures)."""
    policy = Recording(0.05, warmup=1)
    sched = LoopSchedule(policy, clock=lambda: now)
    now = 0.0
    sched.tick(1)
    now = 0.1
    sched.tick(2)
    assert sched.decide(2)
    now += 0.3  # the whole write, on the loop
    sched.saved(2, blocking_s=0.3, waited_s=0.0, staged=None, done=None)
    now += 0.1
    sched.tick(3)
    (stats,) = policy.fed
    assert stats.ok and stats.step == 2
    assert stats.staging_s == pytest.approx(0.3) and stats.persist_s == 0.0
    assert stats.own_exposed_s == pytest.approx(0.3)
