"""`dcp-plus plan --tensors-per-rank`: the save's planning and commit time (measured constants
of benchmarks/scaling.py) are added to the persist time it reports."""

from __future__ import annotations

import pytest

from dcp_plus.cli.main import main
from dcp_plus.cli.plan import CapacityInputError, CapacityInputs, plan_capacity
from dcp_plus.cli.plan.fixed_costs import (
    COORD_S_PER_RANK,
    COORD_S_PER_RANK_TENSOR,
    LOCAL_S_PER_SAVE,
    LOCAL_S_PER_TENSOR,
    Net,
    collective_s,
    fixed_costs,
)

JOB = dict(params=70e9, bytes_per_param=14.0, ranks=1856, storage_gbps=100.0,
           iteration_s=10.0, mtbf_s=12 * 3600.0)
ARGS = ["plan", "--params", "70B", "--bytes-per-param", "14", "--ranks", "1856",
        "--storage-gbps", "100", "--iteration-s", "10", "--mtbf-h", "12"]


def test_commit_grows_with_ranks_times_tensors_and_planning_with_tensors_alone():
    small, wide, deep = fixed_costs(16, 1000), fixed_costs(1600, 1000), fixed_costs(16, 2000)
    net_only = Net(latency_us=0.0, per_message_us=0.0, bandwidth_gbs=1e12)
    assert fixed_costs(1600, 1000, net_only).commit_s == pytest.approx(
        (COORD_S_PER_RANK + COORD_S_PER_RANK_TENSOR * 1000) * 1600, rel=1e-6)
    assert fixed_costs(16, 1000, net_only).planning_s == pytest.approx(
        LOCAL_S_PER_SAVE + LOCAL_S_PER_TENSOR * 1000, rel=1e-6)
    assert wide.commit_s > 50 * small.commit_s
    assert deep.planning_s > small.planning_s and deep.commit_s > small.commit_s
    assert wide.total_s == pytest.approx(wide.planning_s + wide.commit_s)


def test_a_gather_costs_log2_hops_plus_a_message_and_payload_per_rank_at_the_root():
    net = Net(latency_us=10.0, per_message_us=2.0, bandwidth_gbs=1.0)
    assert collective_s("plan_gather", 1024, 1000, net) == pytest.approx(
        10 * 10e-6 + 1024 * (2e-6 + 1000 / 1e9))
    assert collective_s("metadata_broadcast", 1024, 1000, net) == pytest.approx(
        10 * (10e-6 + 1000 / 1e9))


def test_tensors_per_rank_adds_the_fixed_costs_to_persist_and_reports_them():
    bare = plan_capacity(CapacityInputs(**JOB))  # type: ignore[arg-type]
    plan = plan_capacity(CapacityInputs(**JOB, tensors_per_rank=2000))  # type: ignore[arg-type]
    fixed = fixed_costs(1856, 2000)
    assert bare.planning_s is None and bare.commit_s is None
    assert plan.planning_s == pytest.approx(fixed.planning_s)
    assert plan.commit_s == pytest.approx(fixed.commit_s)
    assert plan.persist_s == pytest.approx(bare.persist_s + fixed.total_s)
    assert plan.modes["sync"].blocking_s == pytest.approx(
        bare.modes["sync"].blocking_s + fixed.total_s)


def test_the_command_prints_planning_and_commit_and_refuses_zero_tensors(capsys):
    assert main([*ARGS, "--tensors-per-rank", "2000"]) == 0
    out = capsys.readouterr().out
    assert "of which fixed costs (2,000 tensors per rank, CachedSavePlanner hit): planning " \
        in out and " + commit " in out
    assert main(ARGS) == 0
    assert "fixed costs" not in capsys.readouterr().out
    with pytest.raises(CapacityInputError, match="tensors_per_rank"):
        CapacityInputs(**JOB, tensors_per_rank=0)  # type: ignore[arg-type]
