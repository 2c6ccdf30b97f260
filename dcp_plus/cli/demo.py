"""``dcp-plus demo``: the main job. Train a small transformer on CPU with a
:class:`~dcp_plus.manager.CheckpointManager`, SIGKILL the trainer during a persist at a random
step, restart, resume from the newest committed checkpoint, prove the resumed run bit-exact
against an uninterrupted reference run, and compare the cost with stock ``dcp.async_save``."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dcp_plus.errors import DcpPlusError
from dcp_plus.storage.urls import is_url

MARKER = ".dcp-plus-demo"
WARMUP = 5
"""Iterations AdaptiveInterval measures before its first checkpoint, taken at step
``WARMUP + 1``."""
MIN_STEPS = WARMUP + 2
"""The first checkpoint (step 6) commits, the trainer is killed while persisting a later one
(step 7 at the earliest), and the restart resumes from the first: fewer steps show no resume."""


class TinyLM(nn.Module):
    """A small transformer language model for CPU demos and tests."""

    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build(seed: int = 0, **dims: int) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM(**dims)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, *, vocab: int = 512,
               batch: int = 8, seq: int = 64) -> float:
    """One optimizer step on batch ``step`` (a pure function of the step: resumable)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                       tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def restore(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested state (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.reshape(-1).view(torch.uint8),
                                     b.reshape(-1).view(torch.uint8))))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return value


@dataclass
class RunStats:
    """One training run's checkpoint costs (seconds)."""

    name: str
    steps: int = 0
    wall_s: float = 0.0
    blocking_s: list[float] = field(default_factory=list)
    persist_s: list[float] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        exposed = sum(self.blocking_s)
        return exposed / max(self.wall_s - exposed, 1e-9)


def _progress(total: int, desc: str, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", leave=False,
                file=sys.stderr, disable=not sys.stderr.isatty() or None)


def train_managed(root: str, until: int, *, kill_at: int | None = None,
                  name: str = "CheckpointManager + AdaptiveInterval(p=0.05)",
                  log: Callable[[str], None] = print) -> tuple[RunStats, int | None, Any]:
    """Train to ``until`` under a manager, resuming from ``root`` if it holds a checkpoint.

    With ``kill_at`` (at most ``until``), the first checkpoint at or after that step SIGKILLs
    this process while its data files are being written; when the policy takes none there, a
    last checkpoint at ``until`` does. Returns the stats, the resumed step and the manager's
    policy.
    """
    from dcp_plus.manager import CheckpointManager
    from dcp_plus.schedule import AdaptiveInterval

    def die_in_persist(phase: str, step: int) -> None:
        if kill_at is None or phase != "persist" or step < kill_at:
            return
        path = os.path.join(root, f"step_{step:08d}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
                os.path.isdir(path) and any(n.endswith(".dcpp") for n in os.listdir(path))):
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)

    policy = AdaptiveInterval(0.05, warmup=WARMUP)
    # a restart after the crash takes the dead trainer's lease on the root over
    manager = CheckpointManager(root, keep_last=3, interval=policy, on_phase=die_in_persist,
                                takeover=True)
    if manager.took_over is not None:
        log(f"  took the root's lease over from the killed trainer ({manager.took_over})")
    for path in manager.cleaned:
        log(f"  found and removed the uncommitted checkpoint {path} (no commit record)")
    model, opt = build()
    # the load target comes from a scratch copy: get_state_dict() of a fresh optimizer
    # initializes its state with a zero-lr step, which must not touch the model we train
    scratch_model, scratch_opt = build()
    state = state_of(scratch_model, scratch_opt, 0)
    t0 = time.perf_counter()
    resumed = manager.load_latest(state)
    start = 0
    if resumed is not None:
        restore(model, opt, state)
        start = int(state["step"])
        log(f"  resumed from committed step {resumed} in {time.perf_counter() - t0:.2f} s "
            "(checksums verified)")
    # (never get_state_dict() a fresh optimizer we train: it would take a zero-lr step)
    loaded = snapshot(state_of(model, opt, start)) if resumed is not None else None
    manager.guard(opt)
    stats = RunStats(name)
    bar = _progress(until, "training", start)
    t0 = time.perf_counter()
    for step in range(start + 1, until + 1):
        train_step(model, opt, step)
        manager.maybe_save(step, state_of(model, opt, step))
        bar.update(1)
    if kill_at is not None:  # still alive: no checkpoint fell due at or after kill_at
        manager.save(until, state_of(model, opt, until))
    manager.wait()
    stats.wall_s = time.perf_counter() - t0
    bar.close()
    stats.steps = until - start
    for s in manager.history:
        if s.ok:
            stats.blocking_s.append(s.exposed_s)
            stats.persist_s.append(s.persist_s)
    final = snapshot(state_of(model, opt, until))
    manager.close()
    return stats, resumed, (policy, loaded, final)


def train_reference(until: int, keep: set[int]) -> tuple[RunStats, dict[int, Any]]:
    """The uninterrupted run without checkpoints; snapshots of the steps in ``keep``."""
    model, opt = build()
    stats = RunStats("no checkpointing (reference)", steps=until)
    snaps: dict[int, Any] = {}
    bar = _progress(until, "reference")
    t0 = time.perf_counter()
    for step in range(1, until + 1):
        train_step(model, opt, step)
        if step in keep:
            snaps[step] = snapshot(state_of(model, opt, step))
        bar.update(1)
    stats.wall_s = time.perf_counter() - t0
    bar.close()
    return stats, snaps


def train_stock(root: str, until: int, every: int) -> RunStats:
    """The same loop with stock ``dcp.async_save`` + ``FileSystemWriter`` every ``every`` steps."""
    import torch.distributed.checkpoint as dcp

    model, opt = build()
    stats = RunStats(f"stock dcp.async_save every {every}", steps=until)
    pending: Any = None
    started: dict[int, float] = {}
    bar = _progress(until, "stock async_save")
    t0 = time.perf_counter()
    for step in range(1, until + 1):
        train_step(model, opt, step)
        if step % every == 0:
            b0 = time.perf_counter()
            if pending is not None:
                pending.result()
            started[step] = time.perf_counter()
            resp = dcp.async_save(state_of(model, opt, step), no_dist=True,
                                  storage_writer=dcp.FileSystemWriter(
                                      os.path.join(root, f"step_{step:08d}")))
            stats.blocking_s.append(time.perf_counter() - b0)
            fut: Future[Any] = (resp.upload_completion if isinstance(resp, AsyncSaveResponse)
                                else resp)

            def persisted(_f: Any, s: int = step) -> None:
                stats.persist_s.append(time.perf_counter() - started[s])

            fut.add_done_callback(persisted)
            pending = fut
        bar.update(1)
    if pending is not None:
        pending.result()
    stats.wall_s = time.perf_counter() - t0
    bar.close()
    return stats


def _prepare(root: str) -> None:
    if os.path.exists(root) and not os.path.isdir(root):
        raise DcpPlusError(f"{root} is a file, expected a directory (the checkpoint root)")
    if os.path.isdir(root) and os.listdir(root) and not os.path.exists(
            os.path.join(root, MARKER)):
        raise DcpPlusError(f"{root} is not empty and was not made by the demo; pass an empty "
                           "or new directory (the demo deletes what it made there before)")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    Path(root, MARKER).touch()


def print_runs(rows: list[RunStats], log: Callable[[str], None] = print,
               name_width: int = 46) -> None:
    """One line per run: steps, checkpoints, mean blocking and persist time, wall, overhead."""
    log(f"{'run':<{name_width}} {'steps':>5} {'ckpts':>5} {'blocking ms':>11} {'persist s':>9} "
        f"{'wall s':>7} {'overhead':>8}")
    for r in rows:
        n = len(r.blocking_s)
        blk = f"{1e3 * sum(r.blocking_s) / n:.1f}" if n else "-"
        per = f"{sum(r.persist_s) / len(r.persist_s):.3f}" if r.persist_s else "-"
        log(f"{r.name:<{name_width}} {r.steps:>5} {n:>5} {blk:>11} {per:>9} {r.wall_s:>7.2f} "
            f"{100 * r.overhead:>7.2f}%")


def run(root: str = "./checkpoints", steps: int = 150, seed: int | None = None,
        log: Callable[[str], None] = print) -> bool:
    """The demo; True when the trainer was killed mid-persist, the restart resumed from a
    committed checkpoint, and both the resumed and the final state are bit-exact with an
    uninterrupted run.

    Raises:
        DcpPlusError: ``steps`` below :data:`MIN_STEPS`, or ``root`` unusable.
    """
    from dcp_plus.cli.logs import child_env

    if steps < MIN_STEPS:
        raise DcpPlusError(
            f"--steps {steps}: the demo needs at least {MIN_STEPS}: its first checkpoint is "
            f"taken at step {WARMUP + 1} (after {WARMUP} measured iterations) and must commit "
            "before the trainer is killed during a later one, so that the restart has a "
            "checkpoint to resume from")
    if is_url(root):
        raise DcpPlusError(f"{root}: the demo writes to local directories only for now")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = os.path.abspath(root)
    _prepare(root)
    kill_at = kill_step(steps, seed)
    log(f"1. training {steps} steps of TinyLM (CPU) with CheckpointManager in {root}; the "
        f"trainer will SIGKILL itself during the first persist at or after step {kill_at}")
    child = subprocess.run(
        [sys.executable, "-m", "dcp_plus.cli.demo", "--train", root, str(steps), str(kill_at)],
        stdin=subprocess.DEVNULL, env=child_env(), check=False)
    killed = child.returncode == -signal.SIGKILL
    if killed:
        log(f"   trainer pid killed by SIGKILL (exit {child.returncode})")
    else:
        log(f"   trainer exited with {child.returncode}: it was not killed, so there is no "
            "crash to recover from")

    log("2. restarting: the manager cleans what the crash left and resumes")
    managed, resumed, (policy, loaded, final) = train_managed(root, steps, log=log)
    start = resumed or 0

    log("3. uninterrupted reference run, and the same loop with stock dcp.async_save")
    ref, snaps = train_reference(steps, {start, steps} - {0})
    # stock saves as many checkpoints per step as the manager committed
    k = max(1, round(managed.steps / max(1, len(managed.blocking_s))))
    stock_root = os.path.join(root, "stock-async_save")
    stock = train_stock(stock_root, steps, k)
    shutil.rmtree(stock_root, ignore_errors=True)

    ok_loaded = start == 0 or same(loaded, snaps[start])
    ok_final = same(final, snaps[steps])
    managed.name = f"CheckpointManager (resumed, steps {start + 1}-{steps})"
    log("")
    print_runs([ref, managed, stock], log)
    for d in policy.decisions:
        log(f"   AdaptiveInterval: {d.describe()}")
    if resumed is None:
        log("the restart found no committed checkpoint and trained from step 0: NO RESUME")
    else:
        log(f"resumed state at step {start}: {'bit-exact' if ok_loaded else 'MISMATCH'} with "
            "the reference")
    log(f"final state at step {steps}: {'bit-exact' if ok_final else 'MISMATCH'} with the "
        "reference")
    log(f"checkpoints kept in {root}: "
        f"{sorted(n for n in os.listdir(root) if n.startswith('step_'))}")
    return killed and resumed is not None and ok_loaded and ok_final


def kill_step(steps: int, seed: int | None) -> int:
    """The step from which the trainer kills itself: random in the middle third of the run,
    never before the first checkpoint has been taken (step ``WARMUP + 1``)."""
    lo = max(WARMUP + 2, steps // 3)
    return random.Random(seed).randint(lo, min(steps, max(lo, 2 * steps // 3)))


def _child(root: str, until: str, kill_at: str) -> int:
    from dcp_plus.cli.logs import configure_from_env

    configure_from_env()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    train_managed(root, int(until), kill_at=int(kill_at), log=lambda s: None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--train":
        sys.exit(_child(*sys.argv[2:5]))
    sys.exit(0 if run(sys.argv[1] if len(sys.argv) > 1 else "./checkpoints") else 1)
