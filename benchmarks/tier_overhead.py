"""Training overhead of the memory tier against staging alone, snapshotting every step.

``python -m benchmarks.tier_overhead --dim 512 --layers 8 --steps 30 --pairs 3``: the demo's
TinyLM with AdamW on CPU, ``--threads`` torch threads for training. Rows, each checkpointing
every step, as a step-time overhead against no checkpointing:

* staging alone: an ``ArenaStager(buffers=2)`` snapshot with its optimizer guard, nothing kept
  or persisted (the floor of any snapshot);
* memory tier: ``CheckpointManager(memory_tier=True)`` with its guard; every save stays in
  memory (its first, durable, save is a warm-up, not measured).

The VM's speed drifts within a minute, so each cell is the median over ``--pairs`` of (the
block / a no-checkpoint block right before it), each pair's value in brackets.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from dcp_plus.cli.demo import build, state_of, train_step
from dcp_plus.manager import CheckpointManager
from dcp_plus.stagers import ArenaStager

Block = Callable[[int], float]  # first step -> mean step time of the block


def _mean_step(steps: int, first: int, model: Any, opt: Any,
               after: Callable[[int], None] | None) -> float:
    times = []
    for step in range(first, first + steps):
        t0 = time.perf_counter()
        train_step(model, opt, step)
        if after is not None:
            after(step)
        times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def cell(pairs: int, plain: Block, block: Block, start: int) -> tuple[str, int]:
    ratios = []
    for _ in range(pairs):
        base = plain(start)
        ratios.append(block(start + 1000) / base)
        start += 2000
    med = statistics.median(ratios)
    each = ", ".join(f"{(r - 1) * 100:+.1f}" for r in ratios)
    return f"{(med - 1) * 100:+.1f}% ({each})", start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="steps per block")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, opt = build(dim=a.dim, layers=a.layers)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # + AdamW
    root = tempfile.mkdtemp(prefix="dcpp-bench-overhead-")

    def plain(first: int) -> float:
        return _mean_step(a.steps, first, model, opt, None)

    rows = {}
    stager = ArenaStager(buffers=2, executor="other")
    guard = stager.guard(opt)
    last: list[Future[Any]] = []

    def stage(step: int) -> None:
        last[:] = [stager.stage(state_of(model, opt, step))]  # drops the previous snapshot

    train_step(model, opt, 0)
    stage(0)  # warm-up: the arenas are allocated
    rows["staging alone (ArenaStager, guard)"], start = cell(
        a.pairs, plain, lambda first: _mean_step(a.steps, first, model, opt, stage), 1)
    last.clear()
    guard.remove()
    stager.close()

    m = CheckpointManager(root, memory_tier=True, durable_every=1 << 30,
                          job_id=f"bo{uuid.uuid4().hex[:10]}")
    m.guard(opt)

    def keep(step: int) -> None:
        m.save(step, state_of(model, opt, step))

    keep(start)  # the first save is durable: a warm-up
    m.wait()
    rows["memory tier (CheckpointManager, guard)"], start = cell(
        a.pairs, plain, lambda first: _mean_step(a.steps, first, model, opt, keep), start + 1)
    m.wait()
    m.close()
    shutil.rmtree(root, ignore_errors=True)
    base = plain(start)
    print(f"TinyLM dim {a.dim} x {a.layers} layers: {nbytes / 1e6:.0f} MB state, "
          f"{a.threads} training thread(s), {base * 1e3:.0f} ms a step, every step saved, "
          f"{a.pairs} pairs of {a.steps}-step blocks")
    print("| snapshot every step | overhead vs no checkpoint: median (each pair) |")
    print("|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
