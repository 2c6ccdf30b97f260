"""What the planner needs to know about a job (:class:`CapacityInputs`), its validation, and
the bandwidths and times that follow directly from it.

All sizes are decimal (1 GB = 10^9 bytes); all bandwidths are GB/s; all times are seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dcp_plus.cli.plan.fixed_costs import FixedCosts, fixed_costs
from dcp_plus.errors import DcpPlusError

GB = 1e9


class CapacityInputError(DcpPlusError, ValueError):
    """The planner's inputs are inconsistent; the message names the field, and ``field`` is
    that field's name (for a command line to name its flag)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _refuse(name: str, problem: str) -> CapacityInputError:
    return CapacityInputError(f"{name} {problem}", field=name)


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
    """GPUs (ranks) per host; host memory is per node, and a host is one storage client."""
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
    client_gbps: float | None = None
    """Storage bandwidth of one client (node); ``None`` = not a bound. Writes and reads go at
    most at nodes x ``client_gbps``."""
    peer_gbps: float = 25.0
    """Per-GPU network bandwidth to the partner node holding the peer replica (tiered mode)."""
    iteration_s: float
    """Time of one training step (iteration)."""
    weight_update_s: float | None = None
    """CheckFreq's Tw, the weight-update (optimizer step) part of ``iteration_s``: the snapshot
    overlaps the next iteration's forward and backward pass and must end before its weight
    update, so it blocks for max(0, Tc - (Ti - Tw)). ``None``: use ``stage_hidden_fraction``."""
    mtbf_s: float
    """Mean time between failures of the whole job (node MTBF / nodes)."""
    overhead_budget: float = 0.05
    """CheckFreq's p: the fraction of training time checkpointing may cost."""
    stage_hidden_fraction: float = 0.0
    """Fraction of the device-to-host copy hidden behind forward/backward (0 = the whole copy
    blocks training)."""
    restart_s: float = 0.0
    """Fixed cost of a restart besides loading state: rescheduling, process start, init."""
    tensors_per_rank: int | None = None
    """State-dict tensors each rank saves: adds the projected planning and commit time of a
    ``CachedSavePlanner`` save at ``ranks`` (:mod:`dcp_plus.cli.plan.fixed_costs`) to the
    persist time. ``None``: bytes only."""
    interval_s: float | None = None
    """A chosen training time between checkpoints, to evaluate next to the optimum; rounded
    up to whole steps, never shorter than a checkpoint takes to persist."""

    def __post_init__(self) -> None:
        positive = ("params", "bytes_per_param", "d2h_gbps", "storage_gbps", "peer_gbps",
                    "iteration_s", "mtbf_s")
        optional = ("storage_read_gbps", "client_gbps", "weight_update_s", "interval_s")
        for name in positive + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise _refuse(name, f"must be a positive number, got {value!r}")
        for name in ("ranks", "gpus_per_node", "tensors_per_rank"):
            value = getattr(self, name)
            if value is None and name == "tensors_per_rank":
                continue
            if not (isinstance(value, int) and value >= 1):
                raise _refuse(name, f"must be a positive integer, got {value!r}")
        sd = self.shard_degree
        if sd is not None and not (isinstance(sd, int) and 1 <= sd <= self.ranks
                                   and self.ranks % sd == 0):
            raise _refuse("shard_degree", f"must divide ranks={self.ranks}, got {sd!r} "
                          "(None for fully sharded, 1 for replicated)")
        if not 0 < self.overhead_budget < 1:
            raise _refuse("overhead_budget", f"must lie in (0, 1), got "
                          f"{self.overhead_budget!r} (5% = 0.05)")
        if not 0 <= self.stage_hidden_fraction <= 1:
            raise _refuse("stage_hidden_fraction",
                          f"must lie in [0, 1], got {self.stage_hidden_fraction!r}")
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise _refuse("restart_s", f"must not be negative, got {self.restart_s!r}")
        self._check_overlap_and_interval()

    def _check_overlap_and_interval(self) -> None:
        tw, ti = self.weight_update_s, self.iteration_s
        if tw is not None and tw > ti:
            raise _refuse("weight_update_s", f"({tw:g} s) is part of an iteration and cannot "
                          f"exceed iteration_s ({ti:g} s)")
        if tw is not None and self.stage_hidden_fraction > 0:
            raise _refuse("weight_update_s", "and stage_hidden_fraction both say how much of "
                          "the snapshot overlaps training: give one")
        if self.interval_s is None:
            return
        if self.interval_s < ti:
            raise _refuse("interval_s", f"({self.interval_s:g} s) is shorter than one "
                          f"iteration ({ti:g} s)")
        checkpoint_s = sum(times(self))
        if self.interval_s < checkpoint_s:
            raise _refuse("interval_s", f"({self.interval_s:g} s) is shorter than a checkpoint "
                          f"takes to persist (stage + persist = {checkpoint_s:.4g} s): the "
                          "next one would start before the last is durable")


def bound(storage: float, x: CapacityInputs, n_nodes: int) -> tuple[float, str]:
    """(GB/s, which binds): min(``storage``, nodes x client), ``storage`` or ``clients``."""
    if x.client_gbps is None or storage <= n_nodes * x.client_gbps:
        return storage, "storage"
    return n_nodes * x.client_gbps, "clients"


def nodes(x: CapacityInputs) -> int:
    """Hosts in the job (ranks / GPUs per node, rounded up)."""
    return math.ceil(x.ranks / x.gpus_per_node)


def times(x: CapacityInputs) -> tuple[float, float]:
    """(stage_s, persist_s): one rank's D2H copy, one copy of the state to storage (plus,
    with ``tensors_per_rank``, the save's planning and commit)."""
    per_rank = x.params * x.bytes_per_param / (x.shard_degree or x.ranks)
    gbps = bound(x.storage_gbps, x, nodes(x))[0]
    persist = x.params * x.bytes_per_param / (gbps * GB)
    fixed = fixed_costs_of(x)
    return per_rank / (x.d2h_gbps * GB), persist + (0.0 if fixed is None else fixed.total_s)


def fixed_costs_of(x: CapacityInputs) -> FixedCosts | None:
    """The projected planning and commit time of a save of this job, if it says its
    ``tensors_per_rank``."""
    return None if x.tensors_per_rank is None else fixed_costs(x.ranks, x.tensors_per_rank)
