"""The demo's training loop (TinyLM on CPU) with: no checkpointing, CheckpointManager +
AdaptiveInterval(p=0.05), and stock ``dcp.async_save`` every k steps (k = the interval the
manager settled on); then the manager again with the storage slowed down on purpose for the
middle third of the run, to show the policy adapting.

    python -m benchmarks.manager --steps 300 --slow-ms 400
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

from dcp_plus.cli.demo import RunStats, build, print_runs, state_of, train_step, train_stock
from dcp_plus.manager import CheckpointManager
from dcp_plus.manager.storage import LocalBackend
from dcp_plus.schedule import AdaptiveInterval
from dcp_plus.writers import LocalWriter


class _SlowWriter(LocalWriter):
    """A LocalWriter whose data writes take ``delay_s`` longer (slower storage)."""

    delay_s = 0.0

    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(type(self).delay_s)
        return super().write_data(plan, planner)


class _SlowBackend(LocalBackend):
    def writer(self, path: str, options: Any) -> Any:
        return _SlowWriter(path, overwrite=True, **options)


def no_checkpoints(steps: int) -> RunStats:
    model, opt = build()
    stats = RunStats("no checkpointing", steps=steps)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(model, opt, step)
    stats.wall_s = time.perf_counter() - t0
    return stats


def managed(root: str, steps: int, slow: tuple[int, int] | None = None,
            slow_ms: float = 0.0) -> tuple[RunStats, AdaptiveInterval]:
    policy = AdaptiveInterval(0.05)
    manager = CheckpointManager(root, keep_last=2, interval=policy)
    manager.backend = _SlowBackend()  # a LocalBackend whose writes can be slowed down
    model, opt = build()
    manager.guard(opt)
    name = "CheckpointManager + AdaptiveInterval(0.05)"
    stats = RunStats(name + (f", storage +{slow_ms:.0f} ms/save in steps {slow}" if slow else ""),
                     steps=steps)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        _SlowWriter.delay_s = slow_ms / 1e3 if slow and slow[0] <= step < slow[1] else 0.0
        train_step(model, opt, step)
        manager.maybe_save(step, state_of(model, opt, step))
    manager.wait()
    stats.wall_s = time.perf_counter() - t0
    for s in manager.history:
        if s.ok:
            stats.blocking_s.append(s.exposed_s)
            stats.persist_s.append(s.persist_s)
    manager.close()
    return stats, policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--slow-ms", type=float, default=400.0)
    p.add_argument("--root", default=None)
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    logging.basicConfig(level=logging.WARNING)
    root = args.root or tempfile.mkdtemp(prefix="dcpp-bench-")
    rows = [no_checkpoints(args.steps)]
    mgr, policy = managed(os.path.join(root, "managed"), args.steps)
    rows.append(mgr)
    k = max(1, round(mgr.steps / max(1, len(mgr.blocking_s))))
    rows.append(train_stock(os.path.join(root, "stock"), args.steps, k))
    third = args.steps // 3
    slow, slow_policy = managed(os.path.join(root, "slow"), args.steps, (third, 2 * third),
                                args.slow_ms)
    rows.append(slow)
    shutil.rmtree(root, ignore_errors=True)
    print_runs(rows, name_width=72)
    for title, pol in (("normal storage", policy), ("slowed storage", slow_policy)):
        print(f"\nAdaptiveInterval decisions, {title}:")
        for d in pol.decisions:
            print(f"  {d.describe()}")


if __name__ == "__main__":
    main()
