"""Capacity and checkpoint-policy arithmetic from published models (see ``docs/cli.md``).

Pure computation, no torch: :func:`plan_capacity` turns a :class:`CapacityInputs` into a
:class:`CapacityPlan` with the stage (blocking) and persist times, the CheckFreq interval for
an overhead budget and its rollback bounds, the Young/Daly interval, the host memory an
in-memory tier with a peer replica needs, and the expected goodput of sync, async and tiered
checkpointing under exponential failures (:mod:`dcp_plus.cli.plan.failures`).

All sizes are decimal (1 GB = 10^9 bytes); all bandwidths are GB/s; all times are seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_plus.cli.plan.failures import best_interval_steps, expected_goodput, rollback_s
from dcp_plus.cli.plan.inputs import (
    GB,
    CapacityInputError,
    CapacityInputs,
    bound,
    fixed_costs_of,
    nodes,
    times,
)
from dcp_plus.cli.plan.units import human_duration as _hd
from dcp_plus.tiers.options import tier_copies

__all__ = ["CapacityInputError", "CapacityInputs", "CapacityPlan", "ModePlan",
           "checkfreq_exposed_s", "checkfreq_interval_steps", "plan_capacity",
           "young_daly_interval_s"]

_EPS = 1e-9  # ceil(1/0.05) must be 20, not 21
FIRST_ORDER_LIMIT = 0.1
"""Share of the MTBF above which the first-order (Young/Daly) model is flagged as not holding."""
NO_PROGRESS_GOODPUT = 0.01
"""Goodput below which a mode is flagged as making (almost) no progress."""
GOODPUT_MODEL = ("exponential failures, exact: goodput = (T/M) e^(-(T+L+R)/M) / "
                 "(1 - e^(-(T+C)/M))")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModePlan:
    """One checkpointing mode at one interval, under exponential failures (exact model)."""

    blocking_s: float
    """C: training time lost per checkpoint."""
    durable_after_s: float
    """L: from the checkpoint's start until it can be recovered from."""
    recovery_s: float
    """R: restart cost plus loading the state back."""
    interval_steps: int
    """k: steps between checkpoints (the goodput-maximising one unless chosen), at least 1
    and never shorter than a checkpoint takes to become recoverable."""
    overhead_fraction: float
    """C / (T + C), T = k x Ti: share of failure-free wall time blocked on checkpoints."""
    lost_fraction: float
    """1 - goodput (T + C)/T: share of the rest lost to failures (rollback, restarts), < 1."""
    goodput: float
    """(1 - overhead_fraction) x (1 - lost_fraction): useful share of wall time
    (:func:`~dcp_plus.cli.plan.failures.expected_goodput`)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CapacityPlan:
    """The planner's answer; every field is in the unit its name says."""

    inputs: CapacityInputs
    state_bytes: float
    """Model + optimizer state, one copy."""
    per_rank_state_bytes: float
    """What each rank holds and stages: ``state_bytes / shard_degree``."""
    replicas: int
    nodes: int
    stage_s: float
    """Tc: device-to-host copy of one rank's state (all ranks copy in parallel)."""
    exposed_stage_s: float
    """To: the part of ``stage_s`` that blocks training."""
    persist_gbps: float
    """Write bandwidth used: min(storage_gbps, nodes x client_gbps)."""
    persist_bound: str
    """Which bound binds for writes: ``storage`` or ``clients``."""
    persist_s: float
    """Ts: writing one copy of the state to durable storage at ``persist_gbps``, plus
    ``planning_s`` and ``commit_s``."""
    planning_s: float | None
    """Projected planning time of one save (``inputs.tensors_per_rank`` given), else None."""
    commit_s: float | None
    """Projected commit time of one save (the coordinator's work and the result gather)."""
    load_gbps: float
    """Read bandwidth on restart: min(storage_read_gbps, nodes x client_gbps)."""
    load_bound: str
    load_s: float
    """Reading it back at ``load_gbps``."""
    replicate_s: float
    """Copying one rank's state to its peer at ``peer_gbps``."""
    checkfreq_interval_steps: int
    """k = max(ceil((Tc + Ts - To)/Ti), ceil(To/(p*Ti))) for async checkpoints."""
    checkfreq_overhead_fraction: float
    """To / (k * Ti) at that interval (at most p)."""
    checkfreq_rollback_max_s: float
    """CheckFreq's bound R_max = 2 k Ti: one checkpoint in flight, so at most two intervals."""
    checkfreq_rollback_avg_s: float
    """CheckFreq's R_avg = k Ti."""
    expected_rollback_s: float
    """This job at interval k, failures uniform in time: (T L + T^2/2)/(T + To), T = k Ti,
    L = Tc + Ts (:func:`~dcp_plus.cli.plan.failures.rollback_s`)."""
    worst_rollback_s: float
    """This job at interval k: T + L - To (at most R_max)."""
    daly_interval_s: float
    """First order: sqrt(2 * C * MTBF), C = the blocking time of a synchronous checkpoint."""
    daly_interval_steps: int
    host_memory_per_node_bytes: float
    """Memory and peer tiers: :func:`~dcp_plus.tiers.options.tier_copies` (4) x the per-rank
    state x GPUs per node, the figure ``CheckpointManager`` checks at construction."""
    modes: dict[str, ModePlan] = field(default_factory=dict)
    """``sync``, ``async`` and ``tiered`` at their best intervals (see :func:`plan_capacity`)."""
    at_interval: dict[str, ModePlan] | None = None
    """The same modes at ``inputs.interval_s`` (rounded up to whole steps), if given."""
    goodput_model: str = GOODPUT_MODEL
    warnings: list[str] = field(default_factory=list)
    """Where a model's assumptions do not hold (first order against the MTBF, no progress)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: inputs, figures and modes, units in the key names."""
        return asdict(self)


def _ceil(x: float) -> int:
    return max(1, math.ceil(x - _EPS))


def checkfreq_interval_steps(*, snapshot_s: float, persist_s: float, exposed_s: float,
                             iteration_s: float, overhead_budget: float) -> int:
    """CheckFreq's interval k = max(ceil((Tc + Ts - To)/Ti), ceil(To/(p*Ti))), at least 1.

    Args:
        snapshot_s: Tc, the snapshot (device-to-host copy) time.
        persist_s: Ts, the time to write the snapshot to storage.
        exposed_s: To, the part of the checkpoint that blocks training.
        iteration_s: Ti, one training step.
        overhead_budget: p, e.g. 0.05 for 5%.
    """
    return max(_ceil((snapshot_s + persist_s - exposed_s) / iteration_s),
               _ceil(exposed_s / (overhead_budget * iteration_s)))


def checkfreq_exposed_s(*, snapshot_s: float, iteration_s: float, weight_update_s: float) -> float:
    """CheckFreq's To = max(0, Tc - (Ti - Tw)): the snapshot runs during the next iteration's
    forward and backward pass (Ti - Tw) and must finish before its weight update."""
    return max(0.0, snapshot_s - (iteration_s - weight_update_s))


def young_daly_interval_s(*, checkpoint_s: float, mtbf_s: float) -> float:
    """sqrt(2 * C * MTBF): the interval minimising C/T + T/(2*MTBF) (Young 1974, Daly 2006
    to first order)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def _mode(*, blocking_s: float, durable_after_s: float, recovery_s: float,
          min_interval_s: float, inputs: CapacityInputs, steps: int | None = None) -> ModePlan:
    ti, mtbf = inputs.iteration_s, inputs.mtbf_s
    if steps is None:
        steps = best_interval_steps(blocking_s=blocking_s, recoverable_after_s=durable_after_s,
                                    recovery_s=recovery_s, mtbf_s=mtbf, iteration_s=ti,
                                    min_steps=_ceil(min_interval_s / ti))
    t = steps * ti
    overhead = blocking_s / (t + blocking_s)
    goodput = expected_goodput(compute_s=t, blocking_s=blocking_s,
                               recoverable_after_s=durable_after_s, recovery_s=recovery_s,
                               mtbf_s=mtbf)
    # 1 - overhead rounds to 0 when checkpoints dwarf the compute: then nothing is left to lose
    lost = min(1.0, max(0.0, 1 - goodput / (1 - overhead))) if overhead < 1 else 0.0
    return ModePlan(blocking_s=blocking_s, durable_after_s=durable_after_s,
                    recovery_s=recovery_s, interval_steps=steps, overhead_fraction=overhead,
                    lost_fraction=lost, goodput=min(1.0, max(0.0, goodput)))


def _modes(x: CapacityInputs, *, stage_s: float, exposed: float, persist_s: float,
           load_s: float, replicate_s: float, steps: int | None = None) -> dict[str, ModePlan]:
    sync_c = stage_s + persist_s
    return {
        "sync": _mode(blocking_s=sync_c, durable_after_s=sync_c,
                      recovery_s=x.restart_s + load_s, min_interval_s=0.0, inputs=x,
                      steps=steps),
        "async": _mode(blocking_s=exposed, durable_after_s=stage_s + persist_s,
                       recovery_s=x.restart_s + load_s,
                       min_interval_s=stage_s + persist_s - exposed, inputs=x, steps=steps),
        "tiered": _mode(blocking_s=exposed, durable_after_s=stage_s + replicate_s,
                        recovery_s=x.restart_s + replicate_s + stage_s,
                        min_interval_s=stage_s + replicate_s - exposed, inputs=x, steps=steps),
    }


def _warnings(x: CapacityInputs, *, daly_s: float, sync: ModePlan,
              tables: dict[str, dict[str, ModePlan]]) -> list[str]:
    out = []
    m = x.mtbf_s
    cost = sync.blocking_s + sync.recovery_s
    if max(daly_s, cost) >= FIRST_ORDER_LIMIT * m:
        out.append(
            f"the first-order Young/Daly model assumes the interval and a checkpoint + restart "
            f"are small against the MTBF ({_hd(m)}); here they are {daly_s / m:.0%} and "
            f"{cost / m:.0%} of it, so its interval ({_hd(daly_s)}) is only a rough guide. The "
            f"exact optimum for exponential failures is {sync.interval_steps} steps; the "
            "goodput figures use the exact model")
    for where, modes in tables.items():
        for name, mode in modes.items():
            if mode.goodput < NO_PROGRESS_GOODPUT:
                out.append(f"{name}{where}: goodput {mode.goodput:.2%}: the job would make "
                           f"almost no progress (recovery {_hd(mode.recovery_s)}, recoverable "
                           f"after {_hd(mode.durable_after_s)}, MTBF {_hd(m)})")
    return out


def plan_capacity(inputs: CapacityInputs) -> CapacityPlan:
    """Apply the published models to ``inputs``.

    * stage: each rank copies its shard at ``d2h_gbps``; persist: one copy of the state (DCP
      deduplicates replicas) at min(aggregate ``storage_gbps``, nodes x ``client_gbps``).
    * CheckFreq (Mohan et al., FAST'21): a snapshot must not start before the previous one is
      persisted, and the exposed cost To (``stage_hidden_fraction`` or, with Tw,
      max(0, Tc - (Ti - Tw))) must stay within the budget p; a failure rolls back at most
      2 k Ti (R_max), k Ti on average (R_avg) by CheckFreq's count.
    * Young/Daly (first order): sqrt(2*C*MTBF).
    * Goodput per mode with blocking time C, recoverable-after L and recovery R under
      exponential failures, exactly (:mod:`dcp_plus.cli.plan.failures`), at the interval that
      maximises it: ``sync`` blocks for stage + persist; ``async`` blocks for To and is
      durable after stage + persist; ``tiered`` blocks for To, is recoverable after stage +
      replicate (a peer holds a copy in host memory) and restarts from host memory.
    """
    x = inputs
    shard_degree = x.shard_degree or x.ranks
    n = nodes(x)
    state = x.params * x.bytes_per_param
    per_rank = state / shard_degree
    stage_s, persist_s = times(x)
    fixed = fixed_costs_of(x)
    if x.weight_update_s is None:
        exposed = stage_s * (1 - x.stage_hidden_fraction)
    else:
        exposed = checkfreq_exposed_s(snapshot_s=stage_s, iteration_s=x.iteration_s,
                                      weight_update_s=x.weight_update_s)
    persist_gbps, persist_bound = bound(x.storage_gbps, x, n)
    load_gbps, load_bound = bound(x.storage_read_gbps or x.storage_gbps, x, n)
    load_s = state / (load_gbps * GB)
    replicate_s = per_rank / (x.peer_gbps * GB)
    ti = x.iteration_s

    k = checkfreq_interval_steps(snapshot_s=stage_s, persist_s=persist_s, exposed_s=exposed,
                                 iteration_s=ti, overhead_budget=x.overhead_budget)
    expected, worst = rollback_s(compute_s=k * ti, blocking_s=exposed,
                                 recoverable_after_s=stage_s + persist_s)
    daly_s = young_daly_interval_s(checkpoint_s=stage_s + persist_s, mtbf_s=x.mtbf_s)
    def modes_at(steps: int | None) -> dict[str, ModePlan]:
        return _modes(x, stage_s=stage_s, exposed=exposed, persist_s=persist_s, load_s=load_s,
                      replicate_s=replicate_s, steps=steps)

    modes = modes_at(None)
    at = None if x.interval_s is None else modes_at(_ceil(x.interval_s / ti))
    tables = {"": modes, **({} if at is None else {" at the chosen interval": at})}
    return CapacityPlan(
        inputs=x, state_bytes=state, per_rank_state_bytes=per_rank,
        replicas=x.ranks // shard_degree, nodes=n, stage_s=stage_s,
        exposed_stage_s=exposed, persist_gbps=persist_gbps, persist_bound=persist_bound,
        persist_s=persist_s, planning_s=None if fixed is None else fixed.planning_s,
        commit_s=None if fixed is None else fixed.commit_s, load_gbps=load_gbps, load_bound=load_bound, load_s=load_s,
        replicate_s=replicate_s, checkfreq_interval_steps=k,
        checkfreq_overhead_fraction=exposed / (k * ti),
        checkfreq_rollback_max_s=2 * k * ti, checkfreq_rollback_avg_s=k * ti,
        expected_rollback_s=expected, worst_rollback_s=worst,
        daly_interval_s=daly_s, daly_interval_steps=max(1, round(daly_s / ti)),
        host_memory_per_node_bytes=tier_copies(peer=True) * per_rank
        * min(x.gpus_per_node, x.ranks),
        modes=modes, at_interval=at,
        warnings=_warnings(x, daly_s=daly_s, sync=modes["sync"], tables=tables),
    )
