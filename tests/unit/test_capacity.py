"""The capacity planner reproduces the published figures and follows its stated models."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dcp_plus.cli.plan import (
    CapacityInputError,
    CapacityInputs,
    checkfreq_interval_steps,
    plan_capacity,
    render_text,
    young_daly_interval_s,
)
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
    assert plan.host_memory_per_node_bytes == pytest.approx(2 * 8 * 4.05e12 / 128)
    assert human_bytes(plan.host_memory_per_node_bytes) == "506.2 GB"


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


def test_young_daly_interval_is_sqrt_2_c_mtbf_converted_to_steps():
    assert young_daly_interval_s(checkpoint_s=60.0, mtbf_s=86400.0) == pytest.approx(3219.94,
                                                                                      abs=0.01)
    plan = plan_capacity(llama())
    sync_c = plan.stage_s + plan.persist_s
    assert plan.daly_interval_s == pytest.approx(math.sqrt(2 * sync_c * 3 * 3600.0))
    assert plan.daly_interval_steps == round(plan.daly_interval_s / 5.0)
    assert plan.modes["sync"].interval_steps == plan.daly_interval_steps


def test_sync_goodput_follows_the_stated_lost_work_model():
    plan = plan_capacity(llama(restart_s=120.0))
    m = plan.modes["sync"]
    c, t = plan.stage_s + plan.persist_s, m.interval_steps * 5.0
    r = 120.0 + plan.load_s

    assert (m.blocking_s, m.recovery_s) == pytest.approx((c, r))
    assert m.overhead_fraction == pytest.approx(c / (t + c))
    assert m.lost_fraction == pytest.approx((r + (t + c) / 2 + c) / (3 * 3600.0))
    assert m.goodput == pytest.approx((1 - c / (t + c)) * (1 - m.lost_fraction))


def test_daly_interval_is_near_the_best_sync_goodput():
    base = plan_capacity(llama(mtbf_s=24 * 3600.0))
    best = base.modes["sync"]

    def goodput_at(steps: int) -> float:
        c, t = best.blocking_s, steps * 5.0
        return (t / (t + c)) * (1 - (best.recovery_s + (t + c) / 2 + c) / (24 * 3600.0))

    assert best.goodput == pytest.approx(goodput_at(best.interval_steps))
    assert best.goodput > goodput_at(best.interval_steps // 2)
    assert best.goodput > goodput_at(best.interval_steps * 2)


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
