"""Goodput under exponential failures, exactly (not to first order), and the rollback a
failure costs. Pure arithmetic; see ``docs/cli.md`` ("Model and assumptions").

One checkpointing period: T seconds of compute, then C seconds blocked on the checkpoint; the
checkpoint is recoverable L >= C seconds after it starts (L = C for a synchronous save; an
asynchronous one keeps persisting in the background). A failure costs R seconds of restart
(failures during the restart restart it) and rolls back to the newest recoverable checkpoint.
Failures arrive at rate 1/M (exponential, memoryless).

After a restart, the next checkpoint becomes recoverable T + L later; after that, one more
every T + C. With N the number of checkpoints made recoverable between two failures,
E[N] = e^(-(T+L)/M) / (1 - e^(-(T+C)/M)), and a failure-to-failure cycle lasts
M + M (e^(R/M) - 1) = M e^(R/M) on average, so

    goodput = T E[N] / (M e^(R/M)) = (T/M) e^(-(T+L+R)/M) / (1 - e^(-(T+C)/M)).

For L = C this is Daly's exact model (Daly 2006, "A higher order estimate of the optimum
checkpoint interval for restart dumps"): the expected wall time of one period is
M e^(R/M) (e^((T+C)/M) - 1). It lies in (0, T/(T+C)) for any ratio of T, C, L, R to M, so
no share is ever negative or above 100 %.
"""

from __future__ import annotations

import math

_BISECTIONS = 200


def expected_goodput(*, compute_s: float, blocking_s: float, recoverable_after_s: float,
                     recovery_s: float, mtbf_s: float) -> float:
    """Useful share of wall time for a period of ``compute_s`` + ``blocking_s`` (formula above).

    Args:
        compute_s: T, training time between checkpoints (> 0).
        blocking_s: C, training time lost to each checkpoint.
        recoverable_after_s: L, from the checkpoint's start until a restart can use it (>= C).
        recovery_s: R, restart time.
        mtbf_s: M, mean time between failures.
    """
    lam = 1.0 / mtbf_s
    first = compute_s + recoverable_after_s + recovery_s
    return (lam * compute_s * math.exp(-lam * first)
            / -math.expm1(-lam * (compute_s + blocking_s)))


def optimal_compute_s(*, blocking_s: float, mtbf_s: float) -> float:
    """T maximising :func:`expected_goodput` (it does not depend on L or R).

    Setting the derivative of log(goodput) to zero gives, with x = (T + C)/M,
    x - 1 + e^(-x) = C/M: one root, found by bisection on [C/M, C/M + 1]. To first order
    x = sqrt(2 C/M), i.e. T = sqrt(2 C M) - C, Young's interval; Daly's higher-order
    estimate approximates the same root.
    """
    if blocking_s <= 0:
        return 0.0  # a free checkpoint: take one every step
    target = blocking_s / mtbf_s
    lo, hi = target, target + 1.0
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if mid + math.expm1(-mid) < target:  # x - 1 + e^-x, without cancellation
            lo = mid
        else:
            hi = mid
    return max(0.0, (lo + hi) / 2 * mtbf_s - blocking_s)


def best_interval_steps(*, blocking_s: float, recoverable_after_s: float, recovery_s: float,
                        mtbf_s: float, iteration_s: float, min_steps: int) -> int:
    """Whole steps between checkpoints maximising the goodput, at least ``min_steps``.

    The goodput is unimodal in T, so the best whole number of steps is the floor or the
    ceiling of the continuous optimum (or ``min_steps`` if that is larger).
    """
    steps = optimal_compute_s(blocking_s=blocking_s, mtbf_s=mtbf_s) / iteration_s
    candidates = {max(min_steps, math.floor(steps)), max(min_steps, math.ceil(steps))}

    def goodput(k: int) -> float:
        return expected_goodput(compute_s=k * iteration_s, blocking_s=blocking_s,
                                recoverable_after_s=recoverable_after_s,
                                recovery_s=recovery_s, mtbf_s=mtbf_s)

    return max(sorted(candidates), key=goodput)


def rollback_s(*, compute_s: float, blocking_s: float,
               recoverable_after_s: float) -> tuple[float, float]:
    """(expected, worst) training time a failure rolls back, failures uniform in time.

    A failure v seconds after a checkpoint starts (0 <= v < T + C) loses the compute done
    since then, max(0, v - C), plus the whole previous interval T if the checkpoint is not
    recoverable yet (v < L). Averaged: (T L + T^2 / 2) / (T + C); at most T + L - C. For
    L <= T + C (CheckFreq: one checkpoint in flight) the worst case is at most 2 T.
    """
    t, c = compute_s, blocking_s
    el = min(recoverable_after_s, t + c)
    return (t * el + t * t / 2) / (t + c), t + el - c
