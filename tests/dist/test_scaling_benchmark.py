"""The world-size benchmark runs end to end (2 ranks, tiny sizes) and reports every planner."""

from __future__ import annotations

from pathlib import Path

from benchmarks.scaling import PLANNERS, run
from benchmarks.scaling_model import DEFAULT_NET, PHASES, PROJECT_TO, fits, project, report


def test_a_tiny_run_measures_bytes_cpu_and_memory_and_projects(tmp_path: Path) -> None:
    cfg = {"ranks": 2, "tensors": 20, "saves": 3, "planners": list(PLANNERS),
           "writer": "local", "dir": str(tmp_path)}
    res = run(cfg)
    rows = res["results"]
    assert set(rows) == set(PLANNERS)
    assert [r["hit"] for r in rows["cached_save"]["saves"]] == [False, True, True]
    for name in PLANNERS:
        saves = rows[name]["saves"]
        assert len(saves) == 3
        assert all(r["save_s"] > 0 and r["cpu_s"] > 0 for r in saves)
        assert all(set(r["per_rank_B"]) == set(PHASES) and all(r["per_rank_B"].values())
                   for r in saves)
        # a gather's root takes in every rank's (padded) payload
        assert all(r["coord_B"]["plan_gather"] == 2 * r["per_rank_B"]["plan_gather"]
                   for r in saves)
        mem = rows[name]["memory"]
        assert mem["tracemalloc_peak_B"] > 0 and "at_finish" in mem and "at_record_put" in mem
        assert mem["held_by_planner"] > 0
    assert rows["cached_save"]["memory"]["hit"] is True
    # a hit's plan exchange is smaller than DCP's default planner's full plans
    ours = rows["cached_save"]["saves"][2]["per_rank_B"]["plan_gather"]
    assert ours < rows["dcp_default"]["saves"][2]["per_rank_B"]["plan_gather"]

    f = fits([res], "cached_save")
    cpu, net = project(f, PROJECT_TO[0], DEFAULT_NET)
    assert cpu > 0 and net > 0
    text = "\n".join(report([res]))
    for heading in ("### Per rank count", "### Fits", "### Projection", "436 s"):
        assert heading in text
    assert text.count("| 2 | ") == len(PLANNERS)
