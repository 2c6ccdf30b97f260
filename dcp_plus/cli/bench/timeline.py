"""A short CPU training loop with a checkpoint every k steps, timestamped.

The same loop (``dcp_plus.cli.demo``'s TinyLM + AdamW) runs three times: without checkpoints,
with stock ``dcp.async_save`` + ``FileSystemWriter`` (the default: it stages inside the call;
a new save first waits for the previous one to persist), and with dcp_plus (``ArenaStager``
guarding the optimizer + ``CachedSavePlanner`` + ``LocalWriter``). Every step's start and end,
and every checkpoint's call, return, staged and persisted instants are recorded in seconds from
the start of the run, for the plot and the JSON.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp

NONE = "no checkpoints"
STOCK = "dcp: async_save default"
PLUS = "dcp_plus"


def _stamp(ev: dict[str, Any], key: str, now: Callable[[], float]) -> Callable[[Any], None]:
    def cb(_f: Any) -> None:
        ev.setdefault(key, now())
    return cb


def run_loop(kind: str, root: str, steps: int, every: int, dim: int,
             progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One timestamped run; ``kind`` is :data:`NONE`, :data:`STOCK` or :data:`PLUS`."""
    from dcp_plus.cli.demo import build, state_of, train_step
    from dcp_plus.planners import CachedSavePlanner
    from dcp_plus.stagers import ArenaStager
    from dcp_plus.writers import LocalWriter

    model, opt = build(dim=dim, layers=4)
    train_step(model, opt, 0)  # optimizer state exists before the first checkpoint
    stager = planner = guard = None
    if kind == PLUS:
        stager, planner = ArenaStager(), CachedSavePlanner()
        guard = stager.guard(opt)
    step_times: list[tuple[float, float]] = []
    ckpts: list[dict[str, Any]] = []
    pending: Future[Any] | None = None
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    for step in range(1, steps + 1):
        s0 = now()
        train_step(model, opt, step)
        if kind != NONE and step % every == 0:
            ev: dict[str, Any] = {"step": step, "call": now()}
            if kind == STOCK and pending is not None:
                pending.result()  # one checkpoint in flight at a time, as dcp_plus's buffers=1
            path = os.path.join(root, kind.split(":")[0], f"step_{step:06d}")
            writer = LocalWriter(path) if kind == PLUS else dcp.FileSystemWriter(path)
            resp = dcp.async_save(state_of(model, opt, step), storage_writer=writer,
                                  planner=planner, async_stager=stager, no_dist=True)
            ev["returned"] = now()
            staged: Future[Any] | None = getattr(resp, "staging_completion", None)
            upload: Future[Any] = getattr(resp, "upload_completion", None) or resp  # type: ignore[assignment]
            if staged is None:
                ev["staged"] = ev["returned"]
            else:
                staged.add_done_callback(_stamp(ev, "staged", now))
                if guard is None:
                    staged.result()  # without a guard the update must wait for the snapshot
            upload.add_done_callback(_stamp(ev, "persisted", now))
            pending = upload
            ckpts.append(ev)
        step_times.append((s0, now()))
        progress()
    if pending is not None:
        pending.result()
    wall = now()
    if guard is not None:
        guard.remove()
    if stager is not None:
        stager.close()
    for ev in ckpts:  # a callback may not have run yet when its future was already done
        ev.setdefault("staged", ev["returned"])
        ev.setdefault("persisted", wall)
    return {"steps": step_times, "checkpoints": ckpts, "wall_s": wall}


def run_timeline(root: str, steps: int, every: int, dim: int,
                 progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """The three runs, with ``overhead`` = wall time / (steps x the median step time without
    checkpoints) - 1: the median, because on a shared machine a few slow steps of the
    reference run would otherwise make every other run look faster than no checkpoints."""
    runs: dict[str, Any] = {}
    try:
        for kind in (NONE, STOCK, PLUS):
            runs[kind] = run_loop(kind, root, steps, every, dim, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = steps * statistics.median(b - a for a, b in runs[NONE]["steps"])
    for r in runs.values():
        r["overhead"] = r["wall_s"] / base - 1 if base > 0 else None
    return {"steps": steps, "every": every, "dim": dim, "layers": 4, "runs": runs}
