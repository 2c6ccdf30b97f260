"""Training overhead of the memory tier against staging alone, snapshotting every step.

``python -m benchmarks.tier_overhead --dim 512 --layers 8 --steps 4 --rounds 12``: the demo's
TinyLM with AdamW on CPU, ``--threads`` torch threads for training. Three kinds of block of
``--steps`` steps, each checkpointing every step or not at all:

* plain: no checkpoint;
* staging alone: an ``ArenaStager(buffers=2)`` snapshot with its optimizer guard, nothing kept
  or persisted (the floor of any snapshot);
* memory tier: ``CheckpointManager(memory_tier=True)`` with its guard; every save stays in
  memory (its first, durable, save is a warm-up, not measured).

The VM's speed drifts by 10-20 % within a minute, more than the 1-point goal, so the blocks
are interleaved: each round runs the three once, in a rotating order, and each overhead is a
ratio to the plain block of the same round. Cells: the median over ``--rounds`` with the
quartiles; the last row is the per-round difference memory tier - staging alone, in points.
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


def _quartiles(values: list[float]) -> str:
    q1, med, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{med:+.1f} (quartiles {q1:+.1f} .. {q3:+.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="steps per block")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, opt = build(dim=a.dim, layers=a.layers)
    nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # + AdamW
    root = tempfile.mkdtemp(prefix="dcpp-bench-overhead-")
    stager = ArenaStager(buffers=2, executor="other")
    guard = stager.guard(opt)
    m = CheckpointManager(root, memory_tier=True, durable_every=1 << 30,
                          job_id=f"bo{uuid.uuid4().hex[:10]}")
    m.guard(opt)
    last: list[Future[Any]] = []

    def stage(step: int) -> None:
        last[:] = [stager.stage(state_of(model, opt, step))]  # drops the previous snapshot

    def keep(step: int) -> None:
        m.save(step, state_of(model, opt, step))

    train_step(model, opt, 0)
    stage(0)  # warm-ups: the arenas are allocated, the first (durable) save is done
    keep(0)
    m.wait()
    blocks: dict[str, Callable[[int], None] | None] = {
        "plain": None, "staging": stage, "tier": keep}
    names = list(blocks)
    overhead: dict[str, list[float]] = {"staging": [], "tier": []}
    step = 1
    try:
        for r in range(a.rounds):
            took = {}
            for name in names[r % 3:] + names[:r % 3]:
                took[name] = _mean_step(a.steps, step, model, opt, blocks[name])
                step += a.steps
                m.wait()
                last.clear()
            for name in overhead:
                overhead[name].append((took[name] / took["plain"] - 1) * 100)
            base = took["plain"]
    finally:
        m.close()
        guard.remove()
        stager.close()
        shutil.rmtree(root, ignore_errors=True)
    diff = [t - s for t, s in zip(overhead["tier"], overhead["staging"], strict=True)]
    print(f"TinyLM dim {a.dim} x {a.layers} layers: {nbytes / 1e6:.0f} MB state, "
          f"{a.threads} training thread(s), {base * 1e3:.0f} ms a step, every step saved, "
          f"{a.rounds} rounds of 3 interleaved {a.steps}-step blocks")
    print("| snapshot every step | overhead vs no checkpoint, %: median (quartiles) |")
    print("|---|---|")
    print(f"| staging alone (ArenaStager, guard) | {_quartiles(overhead['staging'])} |")
    print(f"| memory tier (CheckpointManager, guard) | {_quartiles(overhead['tier'])} |")
    print(f"| memory tier - staging alone, points | {_quartiles(diff)} |")


if __name__ == "__main__":
    main()
