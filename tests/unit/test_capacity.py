"""The capacity planner reproduces the published figures and follows its stated models."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from dcp_plus.cli.plan import (
    CapacityInputError,
    CapacityInputs,
    checkfreq_interval_steps,
    plan_capacity,
    render_text,
    young_daly_interval_s,
)
from dcp_plus.cli.plan.failures import expected_goodput
from dcp_plus.cli.plan.units import human_bytes, human_duration

# Llama 3 405B: 4.05 TB of model + optimizer state (10 B/param), split over a 128-rank
# model-parallel group (TP8 x PP16), 16,384 GPUs, 8 per node.
LLAMA3_405B = dict(params=405e9, bytes_per_param=10.0, ranks=16384, gpus_per_node=8,
                   shard_degree=128, d2h_gbps=25.0, storage_gbps=5.0, iteration_s=5.0,
                   mtbf_s=3 * 3600.0)


def llama(**changes: object) -> CapacityInputs:
    return CapacityInputs(**{**LLAMA3_405B, **changes})  # type: ignore[arg-type]


def test_llama3_405b_state_takes_13_5_minutes_to_persist_at_5_gbps():
    plan = plan_capacity(llama())

    assert plan.state_bytes == pytest.approx(4.05e12)
    assert plan.persist_s == pytest.approx(810.0)
    assert human_duration(plan.persist_s) == "13.5 min"
    assert "persist (at 5 GB/s aggregate): 13.5 min" in render_text(plan)


def test_peer_replicated_memory_tier_needs_506_gb_per_node_for_llama3_405b():
    plan = plan_capacity(llama())

    assert plan.per_rank_state_bytes == pytest.approx(31.64e9, rel=1e-3)
    assert plan.host_memory_per_node_bytes == pytest.approx(4 * 8 * 4.05e12 / 128)  # = the tier check
    assert human_bytes(plan.host_memory_per_node_bytes) == "1.01 TB"


def test_checkfreq_interval_is_20_when_a_checkpoint_costs_one_iteration_at_a_5_percent_budget():
    assert checkfreq_interval_steps(snapshot_s=2.0, persist_s=0.5, exposed_s=2.0,
                                    iteration_s=2.0, overhead_budget=0.05) == 20


def test_planner_gives_checkfreq_20_when_staging_blocks_for_one_iteration():
    # 31.64 GB per rank at 25 GB/s = 1.2656 s of staging, all of it exposed
    plan = plan_capacity(llama(iteration_s=4.05e12 / 128 / 25e9, storage_gbps=500.0))

    assert plan.exposed_stage_s == pytest.approx(plan.inputs.iteration_s)
    assert plan.checkfreq_interval_steps == 20
    assert plan.checkfreq_overhead_fraction == pytest.approx(0.05)


def test_checkfreq_never_starts_a_snapshot_before_the_previous_one_is_persisted():
    # 13.5 min of persist at 5 s per step: at least 162 steps apart, whatever the budget
    assert checkfreq_interval_steps(snapshot_s=1.0, persist_s=810.0, exposed_s=1.0,
                                    iteration_s=5.0, overhead_budget=0.05) == 162
    assert plan_capacity(llama()).checkfreq_interval_steps == 162


def test_hiding_staging_behind_compute_shortens_the_budget_bound():
    exposed = plan_capacity(llama(storage_gbps=1e4, iteration_s=1.0))
    hidden = plan_capacity(llama(storage_gbps=1e4, iteration_s=1.0, stage_hidden_fraction=0.75))

    assert hidden.exposed_stage_s == pytest.approx(exposed.exposed_stage_s / 4)
    assert exposed.checkfreq_interval_steps == math.ceil(exposed.stage_s / 0.05)  # 26
    assert hidden.checkfreq_interval_steps == math.ceil(hidden.exposed_stage_s / 0.05)  # 7


def exact_goodput(t: float, c: float, el: float, r: float, m: float) -> float:
    """docs/cli.md: (T/M) e^(-(T+L+R)/M) / (1 - e^(-(T+C)/M))."""
    return (t / m) * math.exp(-(t + el + r) / m) / (1 - math.exp(-(t + c) / m))


def test_young_daly_interval_is_sqrt_2_c_mtbf_converted_to_steps():
    assert young_daly_interval_s(checkpoint_s=60.0, mtbf_s=86400.0) == pytest.approx(3219.94,
                                                                                      abs=0.01)
    plan = plan_capacity(llama())
    sync_c = plan.stage_s + plan.persist_s
    assert plan.daly_interval_s == pytest.approx(math.sqrt(2 * sync_c * 3 * 3600.0))
    assert plan.daly_interval_steps == round(plan.daly_interval_s / 5.0)


def test_the_exact_optimum_approaches_young_daly_when_the_checkpoint_is_small_against_mtbf():
    # C = 811 s against a 1,000 h MTBF: C/M = 2.3e-4, Daly's correction sqrt(C/2M)/3 = 0.4%
    plan = plan_capacity(llama(mtbf_s=1000 * 3600.0))
    assert plan.modes["sync"].interval_steps == pytest.approx(plan.daly_interval_steps,
                                                              rel=0.01)
    assert not plan.warnings
    # at 3 h (C/M = 7.5%) the first-order interval is 14% too long, and the plan says so
    plan = plan_capacity(llama())
    assert plan.modes["sync"].interval_steps < 0.9 * plan.daly_interval_steps
    assert "first-order Young/Daly" in plan.warnings[0]


def test_sync_goodput_is_dalys_exact_expected_time_per_period():
    plan = plan_capacity(llama(restart_s=120.0))
    m = plan.modes["sync"]
    c, t, big_m = plan.stage_s + plan.persist_s, m.interval_steps * 5.0, 3 * 3600.0
    r = 120.0 + plan.load_s

    assert (m.blocking_s, m.recovery_s, m.durable_after_s) == pytest.approx((c, r, c))
    assert m.overhead_fraction == pytest.approx(c / (t + c))
    period = big_m * math.exp(r / big_m) * (math.exp((t + c) / big_m) - 1)  # Daly 2006
    assert m.goodput == pytest.approx(t / period) == pytest.approx(
        exact_goodput(t, c, c, r, big_m))
    assert m.goodput == pytest.approx((1 - m.overhead_fraction) * (1 - m.lost_fraction))


def test_each_mode_checkpoints_at_its_best_whole_number_of_steps():
    base = plan_capacity(llama(mtbf_s=24 * 3600.0))
    for name in ("sync", "tiered"):  # async sits on its feasibility bound (CheckFreq's k)
        best = base.modes[name]

        def goodput_at(steps: int, best=best) -> float:
            return exact_goodput(steps * 5.0, best.blocking_s, best.durable_after_s,
                                 best.recovery_s, 24 * 3600.0)

        k = best.interval_steps
        assert best.goodput == pytest.approx(goodput_at(k))
        assert best.goodput >= max(goodput_at(k - 1), goodput_at(k + 1))
        assert best.goodput > max(goodput_at(k // 2), goodput_at(k * 2))
    assert base.modes["async"].interval_steps == base.checkfreq_interval_steps


def test_exact_goodput_matches_a_simulation_of_failures_and_rollbacks():
    # async-like: blocking C, recoverable L > C after the checkpoint starts, restart R that a
    # failure during it restarts; failures exponential. Simulated wall time, seeded.
    t, c, el, r, big_m = 20.0, 0.5, 20.0, 20.0, 36.0
    rng = random.Random(7)
    now = progress = 0.0
    while now < 2e6:
        fail = now + rng.expovariate(1 / big_m)
        done = max(0, math.floor((fail - now - t - el) / (t + c)) + 1)
        progress += done * t
        now = fail
        while (gap := rng.expovariate(1 / big_m)) < r:
            now += gap
        now += r
    assert progress / now == pytest.approx(exact_goodput(t, c, el, r, big_m), rel=0.02)
    assert expected_goodput(compute_s=t, blocking_s=c, recoverable_after_s=el, recovery_s=r,
                            mtbf_s=big_m) == pytest.approx(exact_goodput(t, c, el, r, big_m))


def test_no_share_leaves_0_to_100_percent_however_short_the_mtbf():
    for mtbf in (3600.0 * 3, 600.0, 60.0, 1.0):
        plan = plan_capacity(llama(mtbf_s=mtbf))
        for mode in plan.modes.values():
            assert 0 <= mode.goodput <= 1 and 0 <= mode.lost_fraction <= 1
    assert any("almost no progress" in w for w in plan.warnings)


def test_checkfreq_rollback_bounds_and_this_jobs_expected_rollback():
    plan = plan_capacity(llama())
    k, ti = plan.checkfreq_interval_steps, 5.0
    t, to, el = k * ti, plan.exposed_stage_s, plan.stage_s + plan.persist_s

    assert plan.checkfreq_rollback_max_s == 2 * k * ti
    assert plan.checkfreq_rollback_avg_s == k * ti
    # failures uniform in time: lose the compute since the checkpoint started, plus the
    # previous interval while it is not durable yet
    assert plan.expected_rollback_s == pytest.approx((t * el + t * t / 2) / (t + to))
    assert plan.worst_rollback_s == pytest.approx(t + el - to)
    assert plan.worst_rollback_s <= plan.checkfreq_rollback_max_s
    rng = random.Random(3)
    lost = [max(0.0, v - to) + (t if v < el else 0.0)
            for v in (rng.uniform(0, t + to) for _ in range(20000))]
    assert sum(lost) / len(lost) == pytest.approx(plan.expected_rollback_s, rel=0.02)
    assert max(lost) == pytest.approx(plan.worst_rollback_s, rel=0.01)


def test_async_blocks_only_for_staging_and_tiered_recovers_from_peer_memory():
    plan = plan_capacity(llama())
    sync, asyn, tiered = (plan.modes[k] for k in ("sync", "async", "tiered"))

    assert asyn.blocking_s == pytest.approx(plan.stage_s) == tiered.blocking_s
    assert asyn.durable_after_s == pytest.approx(plan.stage_s + plan.persist_s)
    assert asyn.interval_steps >= plan.checkfreq_interval_steps  # feasibility bound holds
    assert tiered.recovery_s == pytest.approx(plan.replicate_s + plan.stage_s)
    assert tiered.goodput > asyn.goodput > sync.goodput


def test_replicated_state_is_staged_whole_on_every_rank_but_persisted_once():
    ddp = plan_capacity(CapacityInputs(params=1e9, bytes_per_param=14, ranks=64,
                                       shard_degree=1, storage_gbps=2.0, iteration_s=1.0,
                                       mtbf_s=86400.0))
    fsdp = dataclasses.replace(ddp.inputs, shard_degree=None)

    assert ddp.per_rank_state_bytes == 14e9 and ddp.replicas == 64
    assert plan_capacity(fsdp).per_rank_state_bytes == pytest.approx(14e9 / 64)
    assert ddp.persist_s == plan_capacity(fsdp).persist_s == pytest.approx(7.0)


def test_plan_is_json_serialisable_with_units_in_the_key_names():
    data = json.loads(json.dumps(plan_capacity(llama()).to_dict()))

    assert data["inputs"]["storage_gbps"] == 5.0
    assert data["persist_s"] == pytest.approx(810.0)
    assert set(data["modes"]) == {"sync", "async", "tiered"}
    assert {"blocking_s", "durable_after_s", "goodput"} <= set(data["modes"]["async"])


@pytest.mark.parametrize("change,field", [
    ({"shard_degree": 100}, "shard_degree"),
    ({"storage_gbps": 0.0}, "storage_gbps"),
    ({"ranks": 0}, "ranks"),
    ({"overhead_budget": 5.0}, "overhead_budget"),
    ({"stage_hidden_fraction": -0.1}, "stage_hidden_fraction"),
    ({"mtbf_s": float("nan")}, "mtbf_s"),
])
def test_inconsistent_inputs_are_refused_naming_the_field(change, field):
    with pytest.raises(CapacityInputError, match=field):
        llama(**change)


def test_inputs_are_keyword_only():
    with pytest.raises(TypeError):
        CapacityInputs(405e9, 10.0, 8)  # type: ignore[misc]
