"""Plan-step time, whole-save time and collective bytes: DCP's planners vs CachedSavePlanner.

    python -m benchmarks.planner            # 2 and 4 ranks x 3,000 and 10,000 tensors, 10 saves
    python -m benchmarks.planner --quick    # 2 ranks x 3,000 tensors, 4 saves

Each configuration runs in one spawned gloo world on 127.0.0.1. The state dict holds small
DTensors, half ``Replicate()`` and half ``Shard(0)``, written by a stock ``FileSystemWriter``
(``sync_files=False``) into a temporary directory. Per save, the figure is the slowest rank's:
plan step = ``set_up_planner`` entry to ``finish_plan`` exit (local plan, exchange, global
plan), whole save = ``dcp.save`` wall time, bytes = the largest pickled payload one rank puts
into each of DCP's four object collectives.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_plus.planners.cached_save import CachedSavePlanner
from tests.dist._planner_world import CollectiveBytes, run_world, save_phases

log = logging.getLogger("benchmarks.planner")

PLANNERS = ("dcp_default", "dcp_cached", "cached_save")


class _Timed:
    """Mixin recording the plan step of the last save in ``plan_s``."""

    _t0 = 0.0
    plan_s = 0.0

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        self._t0 = time.perf_counter()
        super().set_up_planner(*args, **kwargs)  # type: ignore[misc]

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)  # type: ignore[misc]
        self.plan_s = time.perf_counter() - self._t0
        return plan


def make_planner(name: str, tag: str) -> Any:
    """A timed planner; DCP's cache is keyed by class name, so each run gets its own class."""
    if name == "dcp_default":
        return type(f"TimedDefault_{tag}", (_Timed, DefaultSavePlanner), {})()
    if name == "dcp_cached":
        return type(f"TimedDcpCached_{tag}", (_Timed, DefaultSavePlanner), {})(
            enable_plan_caching=True
        )
    return type(f"TimedCached_{tag}", (_Timed, CachedSavePlanner), {})()


def state_dict(n: int, world: int) -> dict[str, Any]:
    """``n`` small DTensors: half replicated, half sharded on dim 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, Any] = {}
    for i in range(n):
        t = torch.full((2 * world, 4), float(i))
        placement = Replicate() if i % 2 else Shard(0)
        sd[f"layers.{i // 8}.w{i % 8}"] = distribute_tensor(t, mesh, [placement])
    return {"model": sd}


def _worker(rank: int, world: int, n: int, saves: int, root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    sd = state_dict(n, world)
    counter = CollectiveBytes()
    planners = {name: make_planner(name, f"{world}_{n}") for name in PLANNERS}
    out: dict[str, Any] = {name: [] for name in PLANNERS}
    with counter.count():
        # Interleaved (save i of every planner, then save i+1) so load drift hits all alike.
        for i in range(saves):
            for name, planner in planners.items():
                counter.take()
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/{name}_{i}",
                                                             sync_files=False), planner=planner)
                out[name].append({"plan_s": planner.plan_s, "save_s": time.perf_counter() - t0,
                                  "bytes": save_phases(counter.take())})
    return out


def run(world: int, n: int, saves: int) -> dict[str, list[dict[str, Any]]]:
    """Slowest-rank figures per planner and save."""
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_world(world, _worker, n, saves, root, timeout=1800)
    merged: dict[str, list[dict[str, Any]]] = {}
    for name in PLANNERS:
        merged[name] = []
        for i in range(saves):
            rows = [r[name][i] for r in per_rank]
            merged[name].append({
                "plan_s": max(r["plan_s"] for r in rows),
                "save_s": max(r["save_s"] for r in rows),
                "bytes": {k: max(r["bytes"].get(k, 0) for r in rows)
                          for k in rows[0]["bytes"]},
            })
    return merged


def summarize(world: int, n: int, res: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Table lines: median over saves >= 2, plus first-save figures and ratios."""
    lines = [f"## {world} ranks x {n} tensors"]
    lines.append("| planner | plan 1st (s) | plan >=2 (s) | save 1st (s) | save >=2 (s) | "
                 "plan gather B | plan scatter B | write gather B | md bcast B |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    med: dict[str, tuple[float, float]] = {}
    for name, rows in res.items():
        later = rows[1:] or rows
        plan = statistics.median(r["plan_s"] for r in later)
        save = statistics.median(r["save_s"] for r in later)
        med[name] = (plan, save)
        b = later[-1]["bytes"]
        lines.append(f"| {name} | {rows[0]['plan_s']:.3f} | {plan:.4f} | {rows[0]['save_s']:.3f} "
                     f"| {save:.3f} | {b.get('plan_gather', 0)} | {b.get('plan_scatter', 0)} | "
                     f"{b.get('write_gather', 0)} | {b.get('metadata_broadcast', 0)} |")
    ours = med["cached_save"]
    for ref in ("dcp_cached", "dcp_default"):
        lines.append(f"- vs {ref}: plan step {ours[0] / med[ref][0]:.3f}x, "
                     f"whole save {ours[1] / med[ref][1]:.3f}x (saves >= 2, median)")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a Markdown table per configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks x 3,000 tensors, 4 saves")
    parser.add_argument("--json", help="also write raw figures to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    configs = [(2, 3000)] if args.quick else [(2, 3000), (2, 10000), (4, 3000), (4, 10000)]
    saves = 4 if args.quick else 10
    raw = {}
    for world, n in configs:
        t0 = time.perf_counter()
        res = run(world, n, saves)
        raw[f"{world}x{n}"] = res
        log.info("\n".join(summarize(world, n, res)))
        log.info("(%.0f s)\n", time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
