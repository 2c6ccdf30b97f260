"""``dcp-plus demo``: train a small transformer on CPU, checkpoint asynchronously, reload, and
prove the reloaded state bit-exact."""

from __future__ import annotations

import copy
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from tqdm import tqdm

from dcp_plus.planners import CachedSavePlanner, SafeLoadPlanner
from dcp_plus.readers import LocalReader
from dcp_plus.stagers import ArenaStager
from dcp_plus.writers import LocalWriter


class TinyLM(nn.Module):
    """A two-layer transformer language model, small enough for a CPU demo."""

    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


@dataclass
class SaveTiming:
    step: int
    path: str
    blocking_ms: float
    staged_s: float
    persisted_s: float


def build(seed: int = 0) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int,
               snapshot: Future[Any] | None = None) -> float:
    """One optimizer step; waits for ``snapshot`` (a staging future) before the update."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 512, (8, 64), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                       tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    if snapshot is not None:  # the consistency rule: the snapshot finishes before weights change
        snapshot.result()
    opt.step()
    return loss.item()


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def run(root: str = "./checkpoints", steps: int = 20, every: int = 5,
        log: Callable[[str], None] = print) -> bool:
    """Train, checkpoint every ``every`` steps, reload the last one; True when bit-exact."""
    if "://" in root:
        raise ValueError(f"{root}: object-store URLs are not supported by the demo yet; "
                         "pass a local directory")
    os.makedirs(root, exist_ok=True)
    # single-process demo: DCP warns that it runs without a process group, which is intended
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model, opt = build()
    stager = ArenaStager()
    stager.guard(opt)  # optimizer.step() waits until the snapshot in flight is complete
    planner = CachedSavePlanner()  # plans once, reuses the plan while the structure holds
    timings: list[SaveTiming] = []
    expected: dict[str, Any] = {}
    pending: Any = None
    bar = tqdm(range(1, steps + 1), desc="training", unit="step", leave=False)
    train_t0 = time.perf_counter()
    for step in bar:
        train_step(model, opt, step)
        if step % every == 0:
            if pending is not None:
                pending.result()  # at most one persist in flight
            path = os.path.join(root, f"step_{step:06d}")
            shutil.rmtree(path, ignore_errors=True)
            state = state_of(model, opt, step)
            expected = copy.deepcopy(state)
            t0 = time.perf_counter()
            resp = dcp.async_save(state, storage_writer=LocalWriter(path), async_stager=stager,
                                  planner=planner, no_dist=True)
            blocking = time.perf_counter() - t0
            upload = resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp
            t_step = step

            def done(fut: Any, t0: float = t0, path: str = path, s: int = t_step,
                     b: float = blocking) -> None:
                timings.append(SaveTiming(s, path, b * 1e3, 0.0, time.perf_counter() - t0))
            upload.add_done_callback(done)
            pending = upload
    if pending is not None:
        pending.result()
    stager.close()
    train_s = time.perf_counter() - train_t0

    last = max(timings, key=lambda t: t.step)
    fresh_model, fresh_opt = build(seed=1)
    target = state_of(fresh_model, fresh_opt, 0)
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=LocalReader(last.path), planner=SafeLoadPlanner(),
             no_dist=True)
    load_s = time.perf_counter() - t0
    set_state_dict(fresh_model, fresh_opt, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    ok = same(expected, state_of(fresh_model, fresh_opt, int(target["step"])))

    nbytes = sum(t.numel() * t.element_size() for t in _tensors(expected))
    log(f"trained {steps} steps in {train_s:.2f} s; state {nbytes / 2**20:.1f} MiB; "
        f"checkpoints in {os.path.abspath(root)}")
    log(f"{'step':>6} {'blocking ms':>12} {'persist s':>10}  path")
    for t in sorted(timings, key=lambda t: t.step):
        log(f"{t.step:>6} {t.blocking_ms:>12.1f} {t.persisted_s:>10.3f}  {t.path}")
    log(f"reloaded step {last.step} in {load_s:.3f} s (checksums verified): "
        f"{'bit-exact' if ok else 'MISMATCH'}")
    return ok


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []
