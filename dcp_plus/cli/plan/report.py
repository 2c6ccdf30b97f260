"""Plain-text rendering of a :class:`~dcp_plus.cli.plan.model.CapacityPlan`."""

from __future__ import annotations

from dcp_plus.cli.plan.model import CapacityPlan
from dcp_plus.cli.plan.units import human_bytes, human_count, human_duration


def render_text(plan: CapacityPlan) -> str:
    """The report ``dcp-plus plan`` prints (decimal units, times rounded for reading)."""
    x = plan.inputs
    every_s = plan.checkfreq_interval_steps * x.iteration_s
    lines = [
        f"state: {human_bytes(plan.state_bytes)} ({human_count(x.params)} params x "
        f"{x.bytes_per_param:g} B); {human_bytes(plan.per_rank_state_bytes)} per rank; "
        f"{x.ranks} ranks on {plan.nodes} nodes, {plan.replicas} replica(s)",
        f"stage (D2H at {x.d2h_gbps:g} GB/s per GPU): {human_duration(plan.stage_s)}, "
        f"blocking {human_duration(plan.exposed_stage_s)}",
        f"persist (at {x.storage_gbps:g} GB/s aggregate): {human_duration(plan.persist_s)}; "
        f"load on restart: {human_duration(plan.load_s)}",
        f"CheckFreq interval for a {x.overhead_budget:.0%} budget: every "
        f"{plan.checkfreq_interval_steps} steps ({human_duration(every_s)}), "
        f"overhead {plan.checkfreq_overhead_fraction:.1%}",
        f"Young/Daly interval (sync, MTBF {human_duration(x.mtbf_s)}): "
        f"{human_duration(plan.daly_interval_s)} = {plan.daly_interval_steps} steps",
        f"host memory per node for an in-memory tier with a peer replica: "
        f"{human_bytes(plan.host_memory_per_node_bytes)}",
        "",
        f"{'mode':<8} {'blocking':>10} {'durable':>10} {'recovery':>10} {'every':>8} "
        f"{'overhead':>9} {'lost':>7} {'goodput':>8}",
    ]
    for name, m in plan.modes.items():
        lines.append(
            f"{name:<8} {human_duration(m.blocking_s):>10} {human_duration(m.durable_after_s):>10} "
            f"{human_duration(m.recovery_s):>10} {m.interval_steps:>8} "
            f"{m.overhead_fraction:>9.2%} {m.lost_fraction:>7.2%} {m.goodput:>8.2%}")
    return "\n".join(lines)
