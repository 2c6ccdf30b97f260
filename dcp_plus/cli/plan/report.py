"""Plain-text rendering of a :class:`~dcp_plus.cli.plan.model.CapacityPlan`."""

from __future__ import annotations

from dcp_plus.cli.plan.model import CapacityPlan, ModePlan
from dcp_plus.cli.plan.units import human_bytes, human_count, human_duration


def _bandwidth(plan: CapacityPlan, gbps: float, bound: str, storage: float) -> str:
    x = plan.inputs
    if x.client_gbps is None:
        return f"{gbps:g} GB/s aggregate"
    clients = f"{plan.nodes} nodes x {x.client_gbps:g} GB/s per client"
    if bound == "storage":
        return f"{gbps:g} GB/s: the storage binds, clients {clients}"
    return f"{gbps:g} GB/s: the clients bind, {clients}; storage {storage:g} GB/s"


def _table(modes: dict[str, ModePlan], best: dict[str, ModePlan] | None = None) -> list[str]:
    extra = f" {'vs best':>9}" if best else ""
    lines = [f"{'mode':<8} {'blocking':>10} {'durable':>10} {'recovery':>10} {'every':>8} "
             f"{'overhead':>9} {'lost':>7} {'goodput':>8}{extra}"]
    for name, m in modes.items():
        delta = f" {100 * (m.goodput - best[name].goodput):>+6.2f} pp" if best else ""
        lines.append(
            f"{name:<8} {human_duration(m.blocking_s):>10} {human_duration(m.durable_after_s):>10} "
            f"{human_duration(m.recovery_s):>10} {m.interval_steps:>8} "
            f"{m.overhead_fraction:>9.2%} {m.lost_fraction:>7.2%} {m.goodput:>8.2%}{delta}")
    return lines


def _fixed_line(plan: CapacityPlan) -> list[str]:
    """The planning and commit time in the persist figure, with ``--tensors-per-rank``."""
    if plan.planning_s is None or plan.commit_s is None:
        return []
    return [f"  of which fixed costs ({plan.inputs.tensors_per_rank:,} tensors per rank, "
            f"CachedSavePlanner hit): planning {human_duration(plan.planning_s)} + commit "
            f"{human_duration(plan.commit_s)} (measured constants, docs/benchmarks.md)"]


def render_text(plan: CapacityPlan) -> str:
    """The report ``dcp-plus plan`` prints (decimal units, times rounded for reading)."""
    x = plan.inputs
    ti = x.iteration_s
    every_s = plan.checkfreq_interval_steps * ti
    blocking = f"blocking {human_duration(plan.exposed_stage_s)}"
    if x.weight_update_s is not None:
        blocking += f" = max(0, Tc - (Ti - Tw)) with Tw {human_duration(x.weight_update_s)}"
    read = x.storage_read_gbps or x.storage_gbps
    sync = plan.modes["sync"]
    lines = [
        f"state: {human_bytes(plan.state_bytes)} ({human_count(x.params)} params x "
        f"{x.bytes_per_param:g} B); {human_bytes(plan.per_rank_state_bytes)} per rank; "
        f"{x.ranks} ranks on {plan.nodes} nodes, {plan.replicas} replica(s)",
        f"stage (D2H at {x.d2h_gbps:g} GB/s per GPU): {human_duration(plan.stage_s)}, {blocking}",
        f"persist (at {_bandwidth(plan, plan.persist_gbps, plan.persist_bound, x.storage_gbps)})"
        f": {human_duration(plan.persist_s)}; load on restart: {human_duration(plan.load_s)}"
        + ("" if x.client_gbps is None else
           f" (at {_bandwidth(plan, plan.load_gbps, plan.load_bound, read)})"),
        *_fixed_line(plan),
        f"CheckFreq interval for a {x.overhead_budget:.0%} budget: every "
        f"{plan.checkfreq_interval_steps} steps ({human_duration(every_s)}), "
        f"overhead {plan.checkfreq_overhead_fraction:.1%}",
        f"CheckFreq rollback per failure: R_max = 2 k Ti = "
        f"{human_duration(plan.checkfreq_rollback_max_s)}, R_avg = k Ti = "
        f"{human_duration(plan.checkfreq_rollback_avg_s)}; this job (durable "
        f"{human_duration(plan.stage_s + plan.persist_s)} after each snapshot): expected "
        f"{human_duration(plan.expected_rollback_s)}, at most "
        f"{human_duration(plan.worst_rollback_s)}",
        f"Young/Daly interval (sync, first order, MTBF {human_duration(x.mtbf_s)}): "
        f"{human_duration(plan.daly_interval_s)} = {plan.daly_interval_steps} steps; exact "
        f"optimum: {human_duration(sync.interval_steps * ti)} = {sync.interval_steps} steps",
        f"host memory per node for an in-memory tier with a peer replica: "
        f"{human_bytes(plan.host_memory_per_node_bytes)}",
        "",
        *_table(plan.modes),
    ]
    if plan.at_interval is not None:
        steps = plan.at_interval["sync"].interval_steps
        lines += ["", f"at --interval {human_duration(x.interval_s or 0.0)} (every {steps} "
                      f"steps, {human_duration(steps * ti)}):",
                  *_table(plan.at_interval, best=plan.modes)]
    lines += ["", f"goodput model: {plan.goodput_model}",
              "  (T = every x Ti, C blocking, L durable, R recovery, M MTBF; Daly 2006 for L = C)",
              *(f"WARNING: {w}" for w in plan.warnings)]
    return "\n".join(lines)
