"""Interval policies on a scripted clock: no real time, every number chosen by the test."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import pytest

from dcp_plus.schedule import AdaptiveInterval, DalyInterval, EveryN, SaveStats


@dataclass
class Sim:
    """A training loop on a scripted clock. Each iteration takes ``ti`` seconds; a checkpoint
    exposes ``to`` seconds, snapshots in ``tc`` and persists in ``ts`` more seconds. A save
    issued while the previous persist runs waits for it (the manager's rule). Completed saves
    are reported to the policy at the next iteration, as the manager does."""

    policy: object
    ti: float = 1.0
    to: float = 1.0
    tc: float = 1.0
    ts: float = 2.0
    now: float = 0.0
    step: int = 0
    saves: list[int] = field(default_factory=list)
    _busy_until: float = 0.0
    _pending: list[tuple[float, SaveStats]] = field(default_factory=list)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            t0 = self.now
            exposed = 0.0
            self.now += self.ti
            for done_at, stats in list(self._pending):
                if done_at <= self.now:
                    self._pending.remove((done_at, stats))
                    self.policy.observe_save(stats)
            if self.policy.should_save(self.step):
                waited = max(0.0, self._busy_until - self.now)
                start = self.now + waited
                self.now = start + self.to
                exposed = waited + self.to
                self._busy_until = start + self.tc + self.ts
                self.saves.append(self.step)
                self._pending.append((self._busy_until, SaveStats(
                    self.step, blocking_s=waited + self.to, waited_s=waited,
                    exposed_staging_s=0.0, staging_s=self.tc, persist_s=self.ts)))
            self.policy.observe_iteration(self.now - t0, exposed, update_s=0.1 * self.ti)


def test_k_is_20_when_the_exposed_cost_equals_the_iteration_time_at_p_5_percent():
    # CheckFreq's example: To = Ti and p = 5% give k = ceil(To / (p * Ti)) = 20
    policy = AdaptiveInterval(0.05)
    sim = Sim(policy, ti=1.0, to=1.0, tc=1.0, ts=2.0)
    sim.run(100)
    assert policy.decisions[0].reason == "profiled"
    assert policy.k == 20
    gaps = {b - a for a, b in zip(sim.saves[3:], sim.saves[4:], strict=False)}
    assert gaps == {20}


def test_k_covers_the_persist_when_storage_is_the_bottleneck():
    policy = AdaptiveInterval(0.05)
    Sim(policy, ti=1.0, to=0.01, tc=0.5, ts=30.0).run(200)
    assert policy.k == math.ceil(0.5 + 30.0 - 0.01)  # (Tc + Ts - To) / Ti


def test_k_rises_when_the_writer_is_throttled_and_falls_back_after():
    policy = AdaptiveInterval(0.05)
    sim = Sim(policy, ti=1.0, to=1.0, tc=1.0, ts=2.0)
    sim.run(100)
    assert policy.k == 20
    sim.ts = 60.0  # the storage slows down: saves start waiting for the previous persist
    sim.run(600)
    raised = [d for d in policy.decisions if d.reason == "overhead above p"]
    assert raised and raised[0].overhead > 0.05
    assert policy.k >= 55
    sim.ts = 2.0  # and recovers
    sim.run(600)
    assert policy.decisions[-1].reason == "recovered"
    assert policy.k == 20


def test_the_measured_overhead_stays_within_p_once_tuned():
    policy = AdaptiveInterval(0.05)
    sim = Sim(policy, ti=1.0, to=0.5, tc=2.0, ts=10.0)
    sim.run(50)
    policy.meter.reset()
    sim.run(1000)
    assert policy.meter.overhead <= 0.05 + 1e-9


def test_every_decision_and_the_measured_overhead_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="dcp_plus.schedule")
    policy = AdaptiveInterval(0.05)
    sim = Sim(policy)
    sim.run(100)
    sim.ts = 60.0
    sim.run(300)
    text = caplog.text
    assert "k=20" in text and "profiled" in text and "measured overhead=" in text
    assert "overhead above p" in text


def test_daly_interval_is_sqrt_2_c_mtbf_in_steps():
    policy = DalyInterval(mtbf_s=3600.0, cost_s=2.0)
    Sim(policy, ti=1.0, to=2.0).run(50)
    assert policy.k == round(math.sqrt(2 * 2.0 * 3600.0))  # 120 steps of 1 s
    measured = DalyInterval(mtbf_s=800.0)
    Sim(measured, ti=0.5, to=1.0).run(50)
    assert measured.k == round(math.sqrt(2 * 1.0 * 800.0) / 0.5)


def test_every_n_saves_multiples_of_n():
    sim = Sim(EveryN(7))
    sim.run(50)
    assert sim.saves == [7, 14, 21, 28, 35, 42, 49]
    with pytest.raises(ValueError):
        EveryN(0)
