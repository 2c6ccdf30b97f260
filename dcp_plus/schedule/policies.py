"""Checkpoint interval policies: ``EveryN``, ``DalyInterval`` and CheckFreq's ``AdaptiveInterval``.

The :class:`~dcp_plus.manager.CheckpointManager` feeds a policy from the training thread:
``observe_iteration`` once per ``maybe_save`` call, ``observe_save`` when a checkpoint has
committed (or failed), and asks ``should_save(step)``. Policies are torch-free and clock-free:
they only see the numbers they are given.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

from dcp_plus.schedule.stats import Ewma, OverheadMeter, SaveStats, Window

log = logging.getLogger(__name__)


class IntervalPolicy(Protocol):
    """What the manager asks of an interval policy."""

    def should_save(self, step: int) -> bool:
        """True when ``step`` should be checkpointed."""
        ...

    def observe_iteration(self, wall_s: float, checkpoint_s: float = 0.0,
                          update_s: float | None = None) -> None:
        """One training iteration took ``wall_s``, of which ``checkpoint_s`` was exposed
        checkpoint cost; ``update_s`` is the optimizer step (weight update) time if known."""
        ...

    def observe_save(self, stats: SaveStats) -> None:
        """A checkpoint committed (``stats.ok``) or failed."""
        ...


@dataclass(frozen=True, slots=True)
class Decision:
    """One interval decision, kept in ``policy.decisions`` and logged."""

    step: int
    k: int
    reason: str
    overhead: float | None
    ti: float
    tw: float | None
    tc: float
    ts: float
    to: float
    tg: float | None = None

    def describe(self) -> str:
        ovh = "n/a" if self.overhead is None else f"{100 * self.overhead:.2f}%"
        tw = "n/a" if self.tw is None else f"{1e3 * self.tw:.1f}ms"
        tg = "" if self.tg is None else f" (GPU mode: Tg={1e3 * self.tg:.1f}ms)"
        return (f"k={self.k} at step {self.step} ({self.reason}): Ti={1e3 * self.ti:.1f}ms "
                f"Tw={tw} Tc={1e3 * self.tc:.1f}ms Ts={1e3 * self.ts:.1f}ms "
                f"To={1e3 * self.to:.1f}ms{tg} measured overhead={ovh}")


class EveryN:
    """Checkpoint every ``k`` steps (steps that are multiples of ``k``)."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"EveryN(k) needs k >= 1, got {k}")
        self.k = k
        self.meter = OverheadMeter()

    def should_save(self, step: int) -> bool:
        return step % self.k == 0

    def observe_iteration(self, wall_s: float, checkpoint_s: float = 0.0,
                          update_s: float | None = None) -> None:
        self.meter.add(wall_s, checkpoint_s)

    def observe_save(self, stats: SaveStats) -> None:
        log.info("EveryN(%d): step %d exposed %.1f ms, overhead so far %.2f%%", self.k,
                 stats.step, 1e3 * stats.exposed_s, 100 * self.meter.overhead)


class _Profiled:
    """Shared bookkeeping: iteration/update times, save-time estimates, the last saved step."""

    def __init__(self, warmup: int) -> None:
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 iteration, got {warmup}")
        self.warmup = warmup
        self.ti = Window()
        self.tw = Window()
        self.tc = Ewma()
        self.ts = Ewma()
        self.to = Ewma()
        self.tg = Ewma()
        """GPU-mode snapshots' device copy time (CheckFreq's T_g); the guard waits at most
        this long, so it bounds To from below when the snapshot is in GPU mode."""
        self.meter = OverheadMeter()
        self.k: int | None = None
        self.decisions: list[Decision] = []
        self._step = 0
        self._last_save: int | None = None
        self._outstanding = False
        self._saves = 0

    def observe_iteration(self, wall_s: float, checkpoint_s: float = 0.0,
                          update_s: float | None = None) -> None:
        self.ti.add(max(wall_s - checkpoint_s, 1e-9))
        if update_s is not None:
            self.tw.add(update_s)
        self.meter.add(wall_s, checkpoint_s)

    def _record(self, stats: SaveStats) -> None:
        self._outstanding = False
        if not stats.ok:
            return
        self._saves += 1
        self.tc.add(stats.staging_s)
        self.ts.add(stats.persist_s)
        self.to.add(stats.own_exposed_s)
        if stats.device_copy_s is not None:
            self.tg.add(stats.device_copy_s)

    def _take(self, step: int) -> bool:
        self._step = step
        self._last_save = step
        self._outstanding = True
        return True

    def _decide(self, k: int, reason: str, overhead: float | None) -> None:
        d = Decision(self._step, k, reason, overhead, self.ti.value or 0.0, self.tw.value,
                     self.tc.value or 0.0, self.ts.value or 0.0, self.to.value or 0.0,
                     self.tg.value)
        self.decisions.append(d)
        log.info("%s: %s", type(self).__name__, d.describe())
        self.k = k


class AdaptiveInterval(_Profiled):
    """CheckFreq's adaptive checkpoint interval (Mohan et al., FAST'21).

    Profiles the iteration time Ti, weight-update time Tw, staging time Tc, persist time Ts and
    the exposed (non-overlapped) staging cost To over the first ``warmup`` iterations and
    ``profile_saves`` checkpoints, then checkpoints every

        k = max(ceil((Tc + Ts - To) / Ti), ceil(To / (p * Ti)))

    steps: often enough that the previous persist has finished by the next checkpoint, and
    rarely enough that the exposed cost stays under a fraction ``p`` of training time.

    After every checkpoint it compares the measured overhead (exposed checkpoint time over
    the training time since the last decision) with ``p``: above ``p * (1 + slack)`` (e.g.
    the storage slowed down, so a save had to wait for the previous persist) it re-tunes k
    from the recent measurements; when the recent measurements allow a smaller k again and
    the overhead is within ``p``, it re-tunes back down.

    Args:
        p: the overhead budget, a fraction of iteration time (0.05 = 5%).
        warmup: iterations measured before the first profiling checkpoint.
        profile_saves: checkpoints taken back to back to measure Tc, Ts and To (the first
            one pays first-touch costs, so the estimates use the later ones too).
        slack: tolerance above ``p`` before re-tuning upwards (measurement noise).
        max_k: upper bound on k.
    """

    def __init__(self, p: float = 0.05, *, warmup: int = 5, profile_saves: int = 2,
                 slack: float = 0.2, max_k: int = 100_000) -> None:
        if not 0 < p < 1:
            raise ValueError(f"AdaptiveInterval(p) needs 0 < p < 1, got {p}")
        super().__init__(warmup)
        self.p = p
        self.profile_saves = max(1, profile_saves)
        self.slack = slack
        self.max_k = max_k

    def should_save(self, step: int) -> bool:
        self._step = step
        if self.k is None:  # profiling: warm up, then checkpoint back to back
            if (len(self.ti) >= self.warmup and self._saves < self.profile_saves
                    and not self._outstanding):
                return self._take(step)
            return False
        # once tuned, a save that falls due while the previous persist still runs is not
        # deferred: it waits (exposed cost), which is how slower storage shows up as overhead
        if self._last_save is None or step - self._last_save >= self.k:
            return self._take(step)
        return False

    def interval(self) -> int:
        """k from the current estimates (the formula above)."""
        ti = self.ti.value or 1e-9
        tc, ts, to = self.tc.value or 0.0, self.ts.value or 0.0, self.to.value or 0.0
        cover = math.ceil(max(0.0, tc + ts - to) / ti - 1e-9)
        budget = math.ceil(to / (self.p * ti) - 1e-9)
        return int(min(self.max_k, max(1, cover, budget)))

    def observe_save(self, stats: SaveStats) -> None:
        self._record(stats)
        if not stats.ok:
            return
        if self.k is None:
            if self._saves >= self.profile_saves:
                self.meter.reset()
                self._decide(self.interval(), "profiled", None)
            return
        overhead = self.meter.overhead
        k = self.interval()
        if overhead > self.p * (1 + self.slack):
            self.meter.reset()
            self._decide(max(k, self.k + 1), "overhead above p", overhead)
        elif overhead <= self.p and k < self.k:
            self.meter.reset()
            self._decide(k, "recovered", overhead)
        else:
            log.info("AdaptiveInterval: keeping k=%d at step %d, measured overhead %.2f%% "
                     "(p=%.2f%%)", self.k, stats.step, 100 * overhead, 100 * self.p)


class DalyInterval(_Profiled):
    """Daly's optimal interval for a failure rate: T* = sqrt(2 * C * MTBF) seconds.

    C is the checkpoint cost the training sees (the exposed cost To, measured) unless
    ``cost_s`` fixes it; k = round(T* / Ti) steps. Re-computed after every checkpoint.

    Args:
        mtbf_s: mean time between failures of the job, in seconds.
        cost_s: fixed checkpoint cost; ``None`` measures it.
        warmup: iterations measured before the first (measuring) checkpoint.
    """

    def __init__(self, mtbf_s: float, *, cost_s: float | None = None, warmup: int = 5) -> None:
        if mtbf_s <= 0:
            raise ValueError(f"DalyInterval(mtbf_s) must be positive, got {mtbf_s}")
        super().__init__(warmup)
        self.mtbf_s = mtbf_s
        self.cost_s = cost_s

    def period_s(self) -> float:
        cost = self.cost_s if self.cost_s is not None else (self.to.value or 0.0)
        return math.sqrt(2 * max(cost, 1e-9) * self.mtbf_s)

    def interval(self) -> int:
        return max(1, round(self.period_s() / (self.ti.value or 1e-9)))

    def should_save(self, step: int) -> bool:
        self._step = step
        if self._outstanding:
            return False
        if self.k is None:
            return len(self.ti) >= self.warmup and self._take(step)
        if self._last_save is None or step - self._last_save >= self.k:
            return self._take(step)
        return False

    def observe_save(self, stats: SaveStats) -> None:
        self._record(stats)
        if not stats.ok:
            return
        k = self.interval()
        if k != self.k:
            self._decide(k, f"T*={self.period_s():.2f}s for MTBF={self.mtbf_s:.0f}s",
                         self.meter.overhead if self.k is not None else None)
