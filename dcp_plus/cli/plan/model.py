"""Capacity and checkpoint-policy arithmetic from published models (see ``docs/cli.md``).

Pure computation, no torch: :func:`plan_capacity` turns a :class:`CapacityInputs` into a
:class:`CapacityPlan` with the stage (blocking) and persist times, the CheckFreq interval for
an overhead budget, the Young/Daly interval, the host memory an in-memory tier with a peer
replica needs, and the expected goodput of sync, async and tiered checkpointing.

All sizes are decimal (1 GB = 10^9 bytes); all bandwidths are GB/s; all times are seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_plus.errors import DcpPlusError

_EPS = 1e-9  # ceil(1/0.05) must be 20, not 21


class CapacityInputError(DcpPlusError, ValueError):
    """The planner's inputs are inconsistent (the message names the field)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CapacityInputs:
    """What the planner needs to know about a training job."""

    params: float
    """Number of model parameters (405e9 for Llama 3 405B)."""
    bytes_per_param: float
    """Checkpointed bytes per parameter, model and optimizer state together (weights in bf16
    plus fp32 master weights and two fp32 Adam moments: 2 + 12 = 14)."""
    ranks: int
    """Training processes (GPUs) in the job."""
    gpus_per_node: int = 8
    """GPUs (ranks) per host; host memory is per node."""
    shard_degree: int | None = None
    """Ranks one copy of the state is split over: ``None`` = all ranks (FSDP/ZeRO-3), 1 =
    replicated (DDP), an HSDP shard group size or TP x PP group size otherwise. Replicas
    (``ranks / shard_degree``) hold the same bytes; DCP writes each item once."""
    d2h_gbps: float = 25.0
    """Device-to-host copy bandwidth per GPU (PCIe Gen4 x16 ~25, Gen5 x16 ~50)."""
    storage_gbps: float
    """Aggregate write bandwidth of the durable storage available to the whole job."""
    storage_read_gbps: float | None = None
    """Aggregate read bandwidth for a restart; ``None`` = ``storage_gbps``."""
    peer_gbps: float = 25.0
    """Per-GPU network bandwidth to the partner node holding the peer replica (tiered mode)."""
    iteration_s: float
    """Time of one training step (iteration)."""
    mtbf_s: float
    """Mean time between failures of the whole job (node MTBF / nodes)."""
    overhead_budget: float = 0.05
    """CheckFreq's p: the fraction of training time checkpointing may cost."""
    stage_hidden_fraction: float = 0.0
    """Fraction of the device-to-host copy hidden behind forward/backward (0 = the whole copy
    blocks training)."""
    restart_s: float = 0.0
    """Fixed cost of a restart besides loading state: rescheduling, process start, init."""

    def __post_init__(self) -> None:
        positive = ("params", "bytes_per_param", "d2h_gbps", "storage_gbps", "peer_gbps",
                    "iteration_s", "mtbf_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise CapacityInputError(f"{name} must be a positive number, got {value!r}")
        if self.storage_read_gbps is not None and not self.storage_read_gbps > 0:
            raise CapacityInputError(
                f"storage_read_gbps must be positive, got {self.storage_read_gbps!r}")
        for name in ("ranks", "gpus_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise CapacityInputError(f"{name} must be a positive integer, got {value!r}")
        sd = self.shard_degree
        if sd is not None and not (isinstance(sd, int) and 1 <= sd <= self.ranks
                                   and self.ranks % sd == 0):
            raise CapacityInputError(
                f"shard_degree must divide ranks={self.ranks}, got {sd!r} "
                "(None for fully sharded, 1 for replicated)")
        if not 0 < self.overhead_budget < 1:
            raise CapacityInputError(
                f"overhead_budget must lie in (0, 1), got {self.overhead_budget!r} (5% = 0.05)")
        if not 0 <= self.stage_hidden_fraction <= 1:
            raise CapacityInputError(
                f"stage_hidden_fraction must lie in [0, 1], got {self.stage_hidden_fraction!r}")
        if self.restart_s < 0:
            raise CapacityInputError(f"restart_s must not be negative, got {self.restart_s!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModePlan:
    """One checkpointing mode at its Young/Daly interval (clamped to what is feasible)."""

    blocking_s: float
    """C: training time lost per checkpoint."""
    durable_after_s: float
    """L: from the snapshot until the checkpoint can be recovered from."""
    recovery_s: float
    """R: restart cost plus loading the state back."""
    interval_steps: int
    """Steps between checkpoints: sqrt(2*C*MTBF)/iteration_s, at least 1 and never shorter
    than a checkpoint takes to become recoverable."""
    overhead_fraction: float
    """C / (T + C): share of wall time spent blocked on checkpoints."""
    lost_fraction: float
    """(R + (T + C)/2 + L) / MTBF: share of wall time lost to failures."""
    goodput: float
    """(1 - overhead_fraction) * (1 - lost_fraction): useful share of wall time."""


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
    """Device-to-host copy of one rank's state (all ranks copy in parallel)."""
    exposed_stage_s: float
    """To: the part of ``stage_s`` that blocks training."""
    persist_s: float
    """Writing one copy of the state to durable storage at ``storage_gbps``."""
    load_s: float
    """Reading it back at ``storage_read_gbps``."""
    replicate_s: float
    """Copying one rank's state to its peer at ``peer_gbps``."""
    checkfreq_interval_steps: int
    """k = max(ceil((Tc + Ts - To)/Ti), ceil(To/(p*Ti))) for async checkpoints."""
    checkfreq_overhead_fraction: float
    """To / (k * Ti) at that interval (at most p)."""
    daly_interval_s: float
    """sqrt(2 * C * MTBF) with C = the blocking time of a synchronous checkpoint."""
    daly_interval_steps: int
    host_memory_per_node_bytes: float
    """In-memory tier with a peer replica: 2 x per-rank state x GPUs per node."""
    modes: dict[str, ModePlan] = field(default_factory=dict)
    """``sync``, ``async`` and ``tiered`` (see :func:`plan_capacity`)."""

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


def young_daly_interval_s(*, checkpoint_s: float, mtbf_s: float) -> float:
    """sqrt(2 * C * MTBF): the interval minimising C/T + T/(2*MTBF) (Young 1974, Daly 2006
    to first order)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def _mode(*, blocking_s: float, durable_after_s: float, recovery_s: float,
          min_interval_s: float, inputs: CapacityInputs) -> ModePlan:
    ti, mtbf = inputs.iteration_s, inputs.mtbf_s
    young_daly_s = young_daly_interval_s(checkpoint_s=blocking_s, mtbf_s=mtbf)
    steps = max(round(young_daly_s / ti), _ceil(min_interval_s / ti))
    t = steps * ti
    period = t + blocking_s
    overhead = blocking_s / period
    lost = (recovery_s + period / 2 + durable_after_s) / mtbf
    return ModePlan(blocking_s=blocking_s, durable_after_s=durable_after_s,
                    recovery_s=recovery_s, interval_steps=steps, overhead_fraction=overhead,
                    lost_fraction=lost, goodput=max(0.0, (1 - overhead) * (1 - lost)))


def plan_capacity(inputs: CapacityInputs) -> CapacityPlan:
    """Apply the published models to ``inputs``.

    * stage: each rank copies its shard at ``d2h_gbps``; persist: one copy of the state (DCP
      deduplicates replicas) at the aggregate ``storage_gbps``.
    * CheckFreq (Mohan et al., FAST'21): a snapshot must not start before the previous one is
      persisted, and the exposed cost To must stay within the budget p.
    * Young/Daly: the interval minimising C/T + T/(2*MTBF) is sqrt(2*C*MTBF).
    * Goodput, per mode with blocking time C, recoverable-after L, recovery R and compute T
      between checkpoints: (T/(T+C)) * (1 - (R + (T+C)/2 + L)/MTBF); ``sync`` blocks for
      stage + persist; ``async`` blocks for To and is durable after stage + persist;
      ``tiered`` blocks for To, is recoverable after stage + replicate (a peer holds a copy
      in host memory) and restarts from host memory instead of storage.
    """
    x = inputs
    gb = 1e9
    shard_degree = x.shard_degree or x.ranks
    state = x.params * x.bytes_per_param
    per_rank = state / shard_degree
    stage_s = per_rank / (x.d2h_gbps * gb)
    exposed = stage_s * (1 - x.stage_hidden_fraction)
    persist_s = state / (x.storage_gbps * gb)
    load_s = state / ((x.storage_read_gbps or x.storage_gbps) * gb)
    replicate_s = per_rank / (x.peer_gbps * gb)
    ti, p = x.iteration_s, x.overhead_budget

    k = checkfreq_interval_steps(snapshot_s=stage_s, persist_s=persist_s, exposed_s=exposed,
                                 iteration_s=ti, overhead_budget=p)
    sync_c = stage_s + persist_s
    daly_s = young_daly_interval_s(checkpoint_s=sync_c, mtbf_s=x.mtbf_s)

    modes = {
        "sync": _mode(blocking_s=sync_c, durable_after_s=sync_c,
                      recovery_s=x.restart_s + load_s, min_interval_s=0.0, inputs=x),
        "async": _mode(blocking_s=exposed, durable_after_s=stage_s + persist_s,
                       recovery_s=x.restart_s + load_s,
                       min_interval_s=stage_s + persist_s - exposed, inputs=x),
        "tiered": _mode(blocking_s=exposed, durable_after_s=stage_s + replicate_s,
                        recovery_s=x.restart_s + replicate_s + stage_s,
                        min_interval_s=stage_s + replicate_s - exposed, inputs=x),
    }
    return CapacityPlan(
        inputs=x, state_bytes=state, per_rank_state_bytes=per_rank,
        replicas=x.ranks // shard_degree, nodes=math.ceil(x.ranks / x.gpus_per_node),
        stage_s=stage_s, exposed_stage_s=exposed, persist_s=persist_s, load_s=load_s,
        replicate_s=replicate_s, checkfreq_interval_steps=k,
        checkfreq_overhead_fraction=exposed / (k * ti),
        daly_interval_s=daly_s, daly_interval_steps=max(1, round(daly_s / ti)),
        host_memory_per_node_bytes=2 * per_rank * min(x.gpus_per_node, x.ranks),
        modes=modes,
    )
