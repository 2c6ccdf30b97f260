"""The whole ``dcp-plus bench`` run: the measurement, the timeline, the machine and the
report."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Any

from dcp_plus.cli.bench.cases import torch_checkpointing_status
from dcp_plus.cli.bench.config import BenchConfig
from dcp_plus.cli.bench.machine import load1, machine


def run(cfg: BenchConfig) -> dict[str, Any]:
    """The whole run: the measurement (in this process or a spawned world), the timeline,
    the machine and the derived table rows and ratios (see :mod:`dcp_plus.cli.bench.report`)."""
    from tqdm import tqdm

    from dcp_plus.cli.bench import report
    from dcp_plus.cli.bench.timeline import run_timeline
    from dcp_plus.cli.bench.world import measure_in_process, measure_in_world

    started = time.perf_counter()
    info = machine()
    load_start = load1()
    res = measure_in_process(cfg) if cfg.ranks == 1 else measure_in_world(cfg)
    measured = time.perf_counter()
    timeline = None
    if cfg.timeline_steps > 0:
        with tqdm(total=3 * cfg.timeline_steps, desc="timeline", unit="step", file=sys.stderr,
                  disable=None, leave=False, dynamic_ncols=True) as bar:
            local = cfg.target if not cfg.is_url else tempfile.gettempdir()
            timeline = run_timeline(tempfile.mkdtemp(prefix="dcpp-timeline-", dir=local),
                                    cfg.timeline_steps, cfg.timeline_every, cfg.timeline_dim,
                                    bar.update)
    result = report.build(cfg, res, timeline, info)
    result["load1"] = {"start": round(load_start, 2), "end": round(load1(), 2)}
    tc = torch_checkpointing_status()
    result["notes"] = [n for n in [
        tc if cfg.torch_checkpointing else None,
        "torch_checkpointing runs on local paths with one rank only"
        if tc is None and (cfg.is_url or cfg.ranks > 1) else None,
        "memory:// lives in this process only: the PROCESS-executor row is left out"
        if cfg.target.startswith("memory://") else None] if n]
    result["wall_s"] = round(time.perf_counter() - started, 2)
    result["phases_s"] = {"measure": round(measured - started, 2),
                          "timeline": round(time.perf_counter() - measured, 2)}
    result["median_load1_in_cases"] = statistics.median(
        r["load1"] for r in res["cases"].values()) if res["cases"] else None
    return result
