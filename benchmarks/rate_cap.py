"""Shaped bursts: each rank's measured data write rate against its ``max_bytes_per_s``.

    python -m benchmarks.rate_cap                        # 2 ranks, 256 MiB each, 4 caps
    python -m benchmarks.rate_cap --mib 128 --caps none,32,64 --stagger 0.5 --ranks 2

One spawned gloo world on 127.0.0.1. For each cap, every rank ``async_save``-s its own
``--mib`` MiB tensor through an ``ArenaStager`` and a ``LocalWriter(max_bytes_per_s=cap,
stagger=--stagger)`` into a fresh directory under ``--dir``, the ranks starting together
(barrier). Per rank, the writer's own timing (``last_persist``: data bytes, write seconds)
gives its rate and the rate / cap; per cap, the job's aggregate is every rank's bytes over the
span from the first rank's first write to the last rank's last. ``none``: uncapped (the
device's speed through the same path, for comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch

from tools.testkit.world import run_ranks

MiB = 1 << 20


def _worker(rank: int, world: int, root: str, mib: int, caps: list[float | None],
            stagger: float) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalWriter
    from dcp_plus.stagers import ArenaStager

    warnings.filterwarnings("ignore")
    sd = {f"rank{rank}": torch.randn(mib * MiB // 4, generator=torch.Generator().manual_seed(rank))}
    stager = ArenaStager()
    out = []
    try:
        for k, cap in enumerate(caps):
            path = os.path.join(root, f"cap{k}")
            writer = LocalWriter(path, max_bytes_per_s=cap, stagger=stagger)
            dist.barrier()
            resp = dcp.async_save(sd, storage_writer=writer, async_stager=stager)
            resp.upload_completion.result()
            p = writer.last_persist
            assert p is not None
            out.append({"cap": cap, "bytes": p.data_bytes, "writing": p.writing,
                        "write_s": p.write_s})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        stager.close()
    return out


def report(per_rank: list[list[dict[str, Any]]]) -> list[str]:
    lines = ["| cap, MiB/s | rank | MiB | write s | MiB/s | rate / cap |",
             "|---|---|---|---|---|---|"]
    for k, first in enumerate(per_rank[0]):
        cap = first["cap"]
        label = f"{cap / MiB:g}" if cap else "none"
        rows = [ranks[k] for ranks in per_rank]
        for r, row in enumerate(rows):
            rate = row["bytes"] / row["write_s"]
            ratio = f"{rate / cap:.3f}" if cap else ""
            lines.append(f"| {label} | {r} | {row['bytes'] / MiB:.1f} | {row['write_s']:.3f} "
                         f"| {rate / MiB:.1f} | {ratio} |")
        span = (max(x["writing"] + x["write_s"] for x in rows)
                - min(x["writing"] for x in rows))
        total = sum(x["bytes"] for x in rows)
        lines.append(f"| {label} | all | {total / MiB:.1f} | "
                     f"{span:.3f} | {total / span / MiB:.1f} | |")
    return lines


def _cap(text: str) -> float | None:
    return None if text == "none" else float(text) * MiB


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256, help="MiB saved per rank")
    ap.add_argument("--caps", default="none,64,128,256",
                    help="comma-separated MiB/s per rank ('none': uncapped)")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds per local rank")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    ap.add_argument("--json", help="also write the raw per-rank figures here")
    args = ap.parse_args(argv)
    caps = [_cap(c.strip()) for c in args.caps.split(",")]
    root = tempfile.mkdtemp(prefix="dcpp-rate-bench-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        per_rank = run_ranks(args.ranks, _worker, root, args.mib, caps, args.stagger,
                             timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average after {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s")
    print(f"# {args.ranks} ranks, {args.mib} MiB per rank, stagger {args.stagger} s, "
          f"LocalWriter + ArenaStager (slab data written by the worker processes)")
    print("\n".join(report(per_rank)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per_rank, f, indent=1)


if __name__ == "__main__":
    main()
