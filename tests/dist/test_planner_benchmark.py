"""The plan-caching benchmark runs end to end (tiny sizes) and its report holds every row."""

from __future__ import annotations

from pathlib import Path

from benchmarks.planner import EXCHANGE_BYTES, PLANNERS, report, run


def test_a_tiny_run_measures_every_planner_and_the_exchange_floor(tmp_path: Path) -> None:
    cfg = {"ranks": 2, "tensors": 24, "placement": "mixed", "saves": 3,
           "planners": list(PLANNERS), "sync": "barrier-gc", "dir": str(tmp_path),
           "profile": None, "pin": True}  # --pin-cpus: each rank bound to one CPU
    res = run(cfg)
    rows = res["results"]
    assert set(rows) == set(PLANNERS)
    assert all(len(rows[name]) == 3 for name in PLANNERS)
    assert [r["hit"] for r in rows["cached_save"]] == [False, True, True]
    assert [r["hit"] for r in rows["cached_save_local"]] == [False, True, True]
    floor = rows["exchange"]
    assert all(r["plan_s"] > 0 and r["hit"] is None for r in floor)
    assert all(r["bytes"]["plan_gather"] == EXCHANGE_BYTES for r in floor)
    assert all(r["bytes"]["plan_scatter"] == EXCHANGE_BYTES for r in floor)
    # a hit's plan exchange carries the same payload the floor row sends
    assert rows["cached_save"][2]["bytes"]["plan_gather"] == EXCHANGE_BYTES

    text = "\n".join(report([res]))
    for label in ("DefaultSavePlanner(enable_plan_caching=True)", "CachedSavePlanner",
                  "floor: DCP's plan exchange alone", "plan: floor / DCP cached"):
        assert label in text
    criteria_table = text.split("### Criteria", 1)[1]
    criteria = next(line for line in criteria_table.splitlines()
                    if line.startswith("| 2 x 24 mixed, pinned | "))
    cells = [c.strip() for c in criteria.strip("|").split("|")]
    # plan ours/DCP cached, floor/DCP cached, save, plan and save vs DCP default, LocalWriter
    assert all(c.rstrip(" ✓✗").endswith("x") for c in cells[3:]), cells
