"""HSDP staging skip: bytes copied to host and staging time per rank, with vs without
``ArenaStager(skip_unwritten=planner)``.

    python -m benchmarks.hsdp_skip                  # 4 ranks, HSDP 2 x 2, 512 MiB, 5 saves
    python -m benchmarks.hsdp_skip --size-gib 0.25 --saves 3

One spawned 4-rank gloo world on 127.0.0.1, a 2 x 2 ``("replicate", "shard")`` mesh. The state
dict is GPT-2-like (bf16 weights, fp32 AdamW moments, one step tensor per parameter; ~300
tensors) with every tensor a DTensor placed ``(Replicate(), Shard(0))`` (the layout FSDP2's
HSDP gives), except the 0-dim step tensors, which are plain and identical on every rank. Each
rank holds half of the global bytes; DCP's deduplication gives each chunk to one of its two
replicas.

Two stagers run side by side on every rank, each with its own ``CachedSavePlanner``: ``copy
all`` (stock) and ``skip`` (``skip_unwritten=planner``). Save ``i`` of one, then save ``i`` of
the other, alternating which goes first, so drifting load hits both alike. Both arenas are
``reserve()``-d first, so no save pays first-touch page faults. The writer discards the bytes
(only staging is measured; the save still plans, so the planner records its write set). Per
save and rank: bytes copied (``stager.last_copied_bytes``) and staging time (``async_save``
call to ``staging_completion`` done); the ranks start each save together (barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from typing import Any

import torch

from tools.testkit.world import run_ranks

MODES = ("copy all", "skip")


def hsdp_state_dict(size_gib: float, mesh: Any) -> dict[str, Any]:
    """The GPT-2-like state dict with every non-scalar tensor a ``(Replicate(), Shard(0))``
    DTensor holding this rank's half (zeros, pre-faulted: contents do not change copy time).
    Only the local halves are allocated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dcp_plus.cli.bench.models import (
        MOMENT_DTYPE,
        PARAM_DTYPE,
        adamw_param_groups,
        shape_for_size,
    )

    shape = shape_for_size(size_gib * 2**30)
    coord = mesh.get_coordinate()[1]

    def hsdp(global_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        rows = -(-global_shape[0] // 2)  # torch.chunk: the first shard takes the remainder
        local_rows = rows if coord == 0 else global_shape[0] - rows
        local = torch.zeros((local_rows, *global_shape[1:]), dtype=dtype)
        stride = torch.empty(global_shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                  shape=torch.Size(global_shape), stride=stride)

    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, s in shape.params():
        model[fqn] = hsdp(s, PARAM_DTYPE)
        state[fqn] = {"step": torch.tensor(0.0), "exp_avg": hsdp(s, MOMENT_DTYPE),
                      "exp_avg_sq": hsdp(s, MOMENT_DTYPE)}
    return {"model": model, "optim": {"state": state, "param_groups": adamw_param_groups(shape)}}


def _worker(rank: int, world: int, size_gib: float, saves: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.staging import NullWriter
    from dcp_plus import ArenaStager, CachedSavePlanner
    from dcp_plus.cli.bench.models import iter_tensors

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    sd = hsdp_state_dict(size_gib, mesh)
    local_bytes = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                      for _, t in iter_tensors(sd))
    group = dist.new_group(backend="gloo")
    planners = {m: CachedSavePlanner() for m in MODES}
    stagers = {"copy all": ArenaStager(num_threads=1),
               "skip": ArenaStager(num_threads=1, skip_unwritten=planners["skip"])}
    out: dict[str, Any] = {"local_bytes": local_bytes, "tensors": len(list(iter_tensors(sd)))}
    for mode in MODES:
        stagers[mode].reserve(sd)
        out[mode] = []
    try:
        for i in range(saves):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                stager = stagers[mode]
                dist.barrier(group)
                t0 = time.perf_counter()
                resp = dcp.async_save(sd, storage_writer=NullWriter(), planner=planners[mode],
                                      async_stager=stager, process_group=group)
                t1 = time.perf_counter()
                resp.staging_completion.result()
                t2 = time.perf_counter()
                resp.upload_completion.result()
                del resp
                assert stager.wait_persisted(60)
                out[mode].append({"copied": stager.last_copied_bytes,
                                  "skipped": stager.last_skipped_bytes,
                                  "blocking_ms": (t1 - t0) * 1e3, "staged_ms": (t2 - t0) * 1e3,
                                  "copy_ms": stager.last_copy_s * 1e3,
                                  "hit": planners[mode].last_was_hit})
    finally:
        for s in stagers.values():
            s.close(timeout=30)
    return out


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def report(per_rank: list[dict[str, Any]], saves: int) -> list[str]:
    """A Markdown table: per save and mode, bytes copied, copy time and staging time of every
    rank (r0 r1 r2 r3), then medians over saves >= 2."""
    mib = 1 << 20
    lines = ["| save | mode | MiB copied per rank | copy ms per rank | staging ms per rank "
             "| slowest rank staging ms | plan hit |", "|---|---|---|---|---|---|---|"]

    def cells(rows: list[dict[str, Any]], key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        return " ".join(f"{x[key] / scale:{fmt}}" for x in rows)

    for i in range(saves):
        for mode in MODES:
            rows = [r[mode][i] for r in per_rank]
            lines.append(f"| {i + 1} | {mode} | {cells(rows, 'copied', mib, '.1f')} | "
                         f"{cells(rows, 'copy_ms')} | {cells(rows, 'staged_ms')} | "
                         f"{max(x['staged_ms'] for x in rows):.0f} | {rows[0]['hit']} |")
    later = range(1, saves)
    for mode in MODES:
        def med(key: str, m: str = mode) -> float:
            return statistics.median(r[m][i][key] for r in per_rank for i in later)

        slowest = statistics.median(max(r[mode][i]["staged_ms"] for r in per_rank)
                                    for i in later)
        lines.append(f"- {mode}, saves 2..{saves}: per rank median {med('copied') / mib:.1f} "
                     f"MiB copied, copy {med('copy_ms'):.0f} ms, staging {med('staged_ms'):.0f} "
                     f"ms (blocking {med('blocking_ms'):.0f} ms); slowest rank's staging, "
                     f"median {slowest:.0f} ms")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run the world and print the table (and optionally the raw figures as JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=0.5, help="global state size")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--json", help="also write the raw per-rank figures here")
    args = ap.parse_args(argv)
    before = _loadavg()
    t0 = time.perf_counter()
    per_rank = run_ranks(4, _worker, args.size_gib, args.saves, timeout=1800)
    after = _loadavg()
    print(f"# machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average before {before}, after {after}; {time.perf_counter() - t0:.0f} s")
    print(f"# 4 ranks, HSDP 2 x 2, {args.size_gib} GiB global, {per_rank[0]['tensors']} tensors, "
          f"{per_rank[0]['local_bytes'] / (1 << 20):.1f} MiB local per rank")
    print("\n".join(report(per_rank, args.saves)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per_rank, f, indent=1)


if __name__ == "__main__":
    main()
