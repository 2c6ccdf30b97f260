"""Where a save of many small tensors spends its time, without a profiler: the writer's
sections timed by wrapping them, on every rank of a gloo world, for ``CachedSavePlanner``
and DCP's cached planner, both on ``LocalWriter(fsync=False)``.

    python -m benchmarks.save_sections                      # 2 ranks x 3,000 tensors, 12 saves
    python -m benchmarks.save_sections --tensors 10000 --saves 8

cProfile doubles the cost of code that calls many small functions (the per-item parts), so
its breakdown misstates their share; these are wall-clock medians of saves 2..N of each
section on the coordinator (rank 0), which also does the commit. Sections nest: ``finish``
holds ``collect_extents`` and ``encode_record``; ``write_results`` encodes and puts the
rank's extent table. Each rank saves its own ``--tensors`` tensors of 8 floats (as FSDP
shards are), one planner instance per row reused for every save, the rows interleaved save by
save, ``gc.collect()`` and a barrier before each save (untimed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tools.testkit.world import run_ranks

SECTIONS = [("resolve_items", False), ("plan_files", False), ("_write_files", True),
            ("build_extents", False), ("write_results", False), ("finish", True),
            ("collect_extents", False), ("encode_record", False)]
"""Functions of ``dcp_plus.writers.base`` timed (True: a ``CommittingWriter`` method)."""


def _timed(fn: Callable[..., Any], name: str, acc: dict[str, dict[str, list[float]]],
           row: list[str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[row[0]].setdefault(name, []).append(time.perf_counter() - t)
    return wrapper


def _rank(rank: int, world: int, root: str, tensors: int, saves: int) -> dict[str, Any]:
    import dcp_plus.writers.base as base
    from dcp_plus import CachedSavePlanner, LocalWriter

    rows = {"CachedSavePlanner": CachedSavePlanner(),
            "DefaultSavePlanner(enable_plan_caching=True)": type(
                "SectionsDcpCached", (DefaultSavePlanner,), {})(enable_plan_caching=True)}
    acc: dict[str, dict[str, list[float]]] = {label: {} for label in rows}
    row = [""]
    for name, method in SECTIONS:
        owner: Any = base.CommittingWriter if method else base
        setattr(owner, name, _timed(getattr(owner, name), name, acc, row))
    sd = {"model": {f"r{rank}.layers.{i // 8}.w{i % 8}": torch.full((8,), float(i))
                    for i in range(tensors)}}
    totals: dict[str, list[float]] = {label: [] for label in rows}
    for s in range(saves):  # interleaved, so that load drift hits both rows alike
        for label, planner in rows.items():
            row[0] = label
            gc.collect()
            dist.barrier()
            if s == 1:
                acc[label].clear()
            t = time.perf_counter()
            dcp.save(sd, storage_writer=LocalWriter(f"{root}/{label[:7]}_{s}", fsync=False),
                     planner=planner)
            totals[label].append(time.perf_counter() - t)
    return {label: {"save": statistics.median(totals[label][1:]),
                    **{k: statistics.median(v) for k, v in acc[label].items()}}
            for label in rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=3000, help="per rank")
    ap.add_argument("--saves", type=int, default=12)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        values = run_ranks(a.ranks, _rank, root, a.tensors, a.saves, timeout=600)
    coordinator = values[0]
    labels = list(coordinator)
    print(f"{a.ranks} ranks x {a.tensors:,} tensors, saves 2..{a.saves}, rank 0, ms (median)")
    print("| section | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for key in ["save"] + [n for n, _ in SECTIONS]:
        print(f"| {key} | " + " | ".join(
            f"{1000 * coordinator[lb].get(key, float('nan')):.1f}" for lb in labels) + " |")


if __name__ == "__main__":
    main()
