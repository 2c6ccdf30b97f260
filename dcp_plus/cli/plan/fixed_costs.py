"""A save's fixed costs (planning and commit) against world size and tensors per rank.

A steady save with ``CachedSavePlanner`` (a plan-cache hit) on a dcp_plus writer costs,
besides moving its bytes:

* planning: each rank's own work, per save and per tensor (flatten and fingerprint, the
  write items' and checksums' bookkeeping), in parallel on every rank, plus DCP's plan
  gather and scatter;
* commit: the coordinator reading every rank's extent table and writing the commit record
  (work per rank and per tensor of the world), plus the write-result gather and the
  metadata broadcast.

The constants are measured with ``benchmarks/scaling.py`` on the 2-core dev VM (commands and
figures in ``docs/benchmarks.md``, section "Fixed costs at scale (issue 22)"): the
coordinator's CPU time fitted as ``a + b x ranks`` at 250 and at 1,000 tensors per rank
(2-16 ranks each, 2026-12-06, commit ``13637cb``: with the record memo of a hit), then ``a`` and ``b`` each split into a
constant and a per-tensor part from the two tensor counts. The network is the model stated
there (:class:`Net`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOCAL_S_PER_SAVE = 17.9e-3
"""One rank's own CPU time per hit save, whatever its tensors (files, tables, collectives)."""
LOCAL_S_PER_TENSOR = 7.2e-6
"""One rank's own CPU time per tensor of a hit save."""
COORD_S_PER_RANK = 0.535e-3
"""The coordinator's CPU time per rank (reading its extent table, its share of the
collectives)."""
COORD_S_PER_RANK_TENSOR = 3.18e-6
"""The coordinator's CPU time per tensor of each rank (the table's rows, the record's)."""
HIT_PAYLOAD_B = {"plan_gather": 162, "plan_scatter": 230, "write_gather": 381,
                 "metadata_broadcast": 206}
"""Bytes one rank puts in each collective of a hit (measured; independent of the tensors)."""


@dataclass(frozen=True)
class Net:
    """The network a projection assumes."""

    latency_us: float = 30.0
    """One hop between two hosts (TCP through gloo: tens of microseconds)."""
    per_message_us: float = 5.0
    """The coordinator's cost to receive or send one small message."""
    bandwidth_gbs: float = 12.5
    """The coordinator's link (100 Gb/s front-end Ethernet), GB/s."""


DEFAULT_NET = Net()


def collective_s(phase: str, ranks: int, payload_b: float, net: Net = DEFAULT_NET) -> float:
    """Seconds of one of DCP's save collectives at ``ranks``: a gather or scatter costs
    ``ceil(log2 ranks)`` hops of latency (the size exchange runs first) plus, at the
    coordinator, ``ranks`` messages and ``ranks x payload`` bytes over its link; the metadata
    broadcast ``ceil(log2 ranks)`` hops (a tree) of latency plus the payload's transfer."""
    hops = max(1, math.ceil(math.log2(max(ranks, 2))))
    lat, bw = net.latency_us * 1e-6, net.bandwidth_gbs * 1e9
    if phase == "metadata_broadcast":
        return hops * (lat + payload_b / bw)
    return hops * lat + ranks * (net.per_message_us * 1e-6 + payload_b / bw)


@dataclass(frozen=True)
class FixedCosts:
    """Projected fixed costs of one steady save, seconds."""

    planning_s: float
    commit_s: float

    @property
    def total_s(self) -> float:
        return self.planning_s + self.commit_s


def fixed_costs(ranks: int, tensors_per_rank: int, net: Net = DEFAULT_NET) -> FixedCosts:
    """The planning and commit time of a ``CachedSavePlanner`` hit at this scale."""
    p = HIT_PAYLOAD_B
    planning = LOCAL_S_PER_SAVE + LOCAL_S_PER_TENSOR * tensors_per_rank + sum(
        collective_s(k, ranks, p[k], net) for k in ("plan_gather", "plan_scatter"))
    commit = (COORD_S_PER_RANK + COORD_S_PER_RANK_TENSOR * tensors_per_rank) * ranks + sum(
        collective_s(k, ranks, p[k], net) for k in ("write_gather", "metadata_broadcast"))
    return FixedCosts(planning, commit)
