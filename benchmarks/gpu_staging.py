"""Staging on a GPU (issue 21): ArenaStager's host and GPU modes vs DCP's best stager.

Run: ``python -m benchmarks.gpu_staging [--size-gib 12] [--out result.json]`` on a CUDA
machine (``benchmarks/gpu_check.sh`` runs it with the GPU tests); ``--device cpu`` with small
sizes checks the script itself on a machine without one.

Part A stages a GPT-2-like state dict (bf16 weights and fp32 AdamW moments on the device, the
step counters on CPU, a few thousand tensors) through ``dcp.async_save`` with a writer that
stores nothing, ``--saves`` times per stager, and reports per save: the blocking time (the
call's return), the release (``synchronize_staging()`` returns: the next optimizer step may
run) and staged (the snapshot is in host memory). Next to them, from the same run: the D2H
limit (one ``copy_`` of the same bytes from device memory into a page-locked buffer) and the
HBM limit (one device-to-device ``copy_`` of the same bytes).

Part B trains a small GPT (embedding, pre-norm transformer layers, bf16 autocast, fp32 AdamW)
and checkpoints every 1, 5 and 20 steps to local disk: the step-time overhead against no
checkpointing, ours (``LocalWriter`` + ``CachedSavePlanner`` + ``ArenaStager`` with its guard)
against DCP's best (``FileSystemWriter`` + ``DefaultStager(T,T,T,T)`` + plan caching).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from benchmarks.staging import NullWriter, gpt2_like_state_dict, state_bytes
from dcp_plus import CachedSavePlanner, LocalWriter
from dcp_plus.stagers import ArenaStager
from tools.testkit.world import single_rank_world

GiB = 1 << 30
T, P = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_of(fn: Callable[[], None], device: str, repeats: int = 3) -> float:
    """Fastest of ``repeats`` timed runs of ``fn`` (after one warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def limits(nbytes: int, device: str) -> dict[str, float]:
    """D2H: one copy of ``nbytes`` into page-locked host memory; HBM: one device copy."""
    cuda = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
    out = {"d2h_s": best_of(functools.partial(host.copy_, src, non_blocking=cuda), device)}
    host = torch.empty(0)
    if cuda and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the pinned block stays cached otherwise
    other = torch.empty_like(src)
    out["hbm_s"] = best_of(functools.partial(other.copy_, src), device)
    src = other = torch.empty(0)
    if cuda:
        torch.cuda.empty_cache()
    return out


def dcp_best(device: str) -> DefaultStager:
    """DCP's fastest stager (TorchTitan's ``async_with_pinned_mem``); pinned memory needs
    CUDA."""
    cuda = device.startswith("cuda")
    return DefaultStager(StagingOptions(cuda, True, True, cuda))


def stage_cases(device: str) -> list[tuple[str, Callable[[], Any], AsyncCheckpointerType]]:
    return [
        ("ArenaStager host (device_copy='never')", lambda: ArenaStager(device_copy="never"), T),
        ("ArenaStager GPU mode (device_copy='always')",
         lambda: ArenaStager(device_copy="always"), T),
        ("ArenaStager auto", lambda: ArenaStager(), T),
        ("DCP DefaultStager(T,T,T,T) thread", lambda: dcp_best(device), T),
        ("TorchTitan async_with_pinned_mem (DefaultStager(T,T,T,T), process)",
         lambda: dcp_best(device), P),
    ]


def time_save(sd: dict[str, Any], stager: Any, kind: AsyncCheckpointerType,
              device: str) -> dict[str, Any]:
    """One ``async_save`` of ``sd``: blocking, release and staged times (seconds)."""
    sync(device)
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, storage_writer=NullWriter(), async_stager=stager,
                          async_checkpointer_type=kind)
    t1 = time.perf_counter()
    stager.synchronize_staging()
    t2 = time.perf_counter()
    resp.staging_completion.result()
    t3 = time.perf_counter()
    resp.upload_completion.result()
    row: dict[str, Any] = {"blocking_s": t1 - t0, "release_s": t2 - t0, "staged_s": t3 - t0}
    if isinstance(stager, ArenaStager):
        st = stager.device_copy_status
        row.update(device_copy_s=st.last_device_copy_s, device_bytes=st.held_bytes,
                   reason=st.reason)
    return row


def shm_fit_gib(size_gib: float, copies: float = 2.5) -> float:
    """``size_gib``, lowered so ``copies`` snapshots fit in /dev/shm's free space (a container
    may give it far less than the host's memory)."""
    st = os.statvfs("/dev/shm")
    free_gib = st.f_bavail * st.f_frsize / GiB
    if free_gib < copies * size_gib:
        print(f"# /dev/shm has {free_gib:.1f} GiB free: staging {free_gib / copies:.2f} GiB "
              f"instead of {size_gib}", flush=True)
        return free_gib / copies
    return size_gib


def part_a(size_gib: float, layers: int, saves: int, device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    size_gib = shm_fit_gib(size_gib)
    sd = gpt2_like_state_dict(int(size_gib * GiB), layers, device)
    n, nbytes = state_bytes(sd)
    lim = limits(nbytes, device)
    print(f"## Part A: {n} tensors, {nbytes / GiB:.2f} GiB on {device}; D2H limit "
          f"{lim['d2h_s'] * 1e3:.0f} ms ({nbytes / lim['d2h_s'] / 1e9:.1f} GB/s), HBM copy "
          f"{lim['hbm_s'] * 1e3:.1f} ms", flush=True)
    print("| stager | save | blocking ms | release ms | staged ms | staged / D2H | "
          "release / HBM |")
    print("|---|---|---|---|---|---|---|")
    rows: dict[str, Any] = {}
    for name, make, kind in stage_cases(device):
        stager = make()
        got = []
        try:
            for i in range(saves):
                r = time_save(sd, stager, kind, device)
                got.append(r)
                print(f"| {name} | {i + 1} | {r['blocking_s'] * 1e3:.1f} | "
                      f"{r['release_s'] * 1e3:.1f} | {r['staged_s'] * 1e3:.0f} | "
                      f"{r['staged_s'] / lim['d2h_s']:.2f}x | "
                      f"{r['release_s'] / lim['hbm_s']:.1f}x |", flush=True)
            if isinstance(stager, ArenaStager):
                got.append({"staged_bit_exact": staged_matches(stager, sd)})
        except (Exception, torch.distributed.checkpoint.api.CheckpointException) as e:
            print(f"| {name} | failed: {e!r:.200} |", flush=True)
            got.append({"error": repr(e)})
        finally:
            close = getattr(stager, "close", None)
            if close is not None:
                close()
        rows[name] = {"saves": got, "first": got[0] if got else None,
                      "steady": _median_rows(got[1:])}
    del sd
    return {"tensors": n, "bytes": nbytes, "limits": lim, "cases": rows}


def staged_matches(stager: ArenaStager, sd: dict[str, Any]) -> bool:
    """Stage ``sd`` once more and compare every model weight and a moment with the live ones
    (a timing of a snapshot that stages wrong bytes would mean nothing)."""
    staged = stager.stage(sd).result()
    ok = all(torch.equal(staged["model"][k], v.cpu()) for k, v in sd["model"].items())
    first = next(iter(sd["optim"]["state"]))
    ok = ok and torch.equal(staged["optim"]["state"][first]["exp_avg"],
                            sd["optim"]["state"][first]["exp_avg"].cpu())
    del staged
    stager.wait_persisted(60)
    print(f"# {stager.device_copy_status.mode}: staged bytes "
          f"{'equal the live ones' if ok else 'DIFFER FROM THE LIVE ONES'}", flush=True)
    return ok


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    rows = [r for r in rows if "error" not in r and "blocking_s" in r]
    if not rows:
        return None
    keys = ("blocking_s", "release_s", "staged_s")
    return {k: statistics.median(r[k] for r in rows) for k in keys}


class GPT(torch.nn.Module):
    """Embedding, ``layers`` pre-norm transformer layers, tied output head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(
            tokens.shape[1], device=tokens.device)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.emb.weight.T


def part_b(params_m: float, steps: int, every: tuple[int, ...], out_dir: str,
           device: str, batch: int, seq: int, budget_s: float,
           emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Training overhead; an interval that would start after ``budget_s`` is skipped (noted).
    ``emit(result)`` writes the results so far."""
    t_start = time.perf_counter()
    params_m = fit_to_memory(params_m, out_dir)
    vocab, layers = 32_000, max(2, round(params_m / 60))
    d = int(math.sqrt(params_m * 1e6 / (12 * layers)))
    d = max(128, d - d % 128)  # heads of 128
    torch.manual_seed(0)
    model = GPT(vocab, d, layers, d // 128).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    nparams = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)

    def step(before_update: Callable[[], Any] | None = None) -> None:
        opt.zero_grad(set_to_none=False)
        with autocast:
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()
        if before_update is not None:
            before_update()
        opt.step()
        if device.startswith("cuda"):  # a step's time is the GPU's, not the launch queue's;
            torch.cuda.current_stream().synchronize()  # not the stager's side stream

    for _ in range(3):
        step()

    def run(k: int | None, stack: dict[str, Any] | None, nsteps: int) -> float:
        pending: list[Any] = []
        dirs: list[str] = []
        times = []
        for i in range(nsteps):
            t = time.perf_counter()
            wait = None
            if k and i % k == 0 and stack is not None:
                while pending:  # at most one persist in flight, as TorchTitan does
                    pending.pop(0).result()
                dirs.append(os.path.join(out_dir, f"{stack['name'][:3]}-{i}-{time.time_ns()}"))
                resp = dcp.async_save(
                    {"model": model.state_dict(), "optim": opt.state_dict()},
                    storage_writer=stack["writer"](dirs[-1]), planner=stack["planner"],
                    async_stager=stack["stager"], async_checkpointer_type=stack["kind"])
                pending.append(resp.upload_completion)
                if not stack["guarded"]:
                    wait = stack["stager"].synchronize_staging
            step(wait)
            times.append(time.perf_counter() - t)
            while len(dirs) > len(pending) + 1:  # retention, outside the timed step
                shutil.rmtree(dirs.pop(0), ignore_errors=True)
        for f in pending:
            f.result()
        for p in dirs:
            shutil.rmtree(p, ignore_errors=True)
        return statistics.mean(times)

    base = run(None, None, steps)
    print(f"\n## Part B: {nparams / 1e6:.0f}M params (d={d}, {layers} layers; "
          f"{nparams * 12 / 1e9:.1f} GB checkpoint), batch {batch}x{seq}, step "
          f"{base * 1e3:.0f} ms on {device}", flush=True)
    stacks = [
        {"name": "dcp_plus (LocalWriter + CachedSavePlanner + ArenaStager guard)",
         "writer": LocalWriter, "planner": CachedSavePlanner(), "stager": ArenaStager(),
         "kind": T, "guarded": True},
        {"name": "DCP best (FileSystemWriter + DefaultStager(T,T,T,T) + plan caching)",
         "writer": dcp.FileSystemWriter,
         "planner": dcp.DefaultSavePlanner(enable_plan_caching=True),
         "stager": dcp_best(device), "kind": T, "guarded": False},
    ]
    result: dict[str, Any] = {"params": nparams, "d": d, "layers": layers, "step_s": base,
                              "cells": {}}

    def cell(stack: dict[str, Any], k: int, n: int) -> float:
        guard = stack["stager"].guard(opt, prefault=False) if stack["guarded"] else None
        try:
            return run(k, stack, n)
        finally:
            if guard is not None:
                guard.remove()

    try:
        for stack in stacks:
            cell(stack, 1, 2)  # warm-up: the first save allocates
        # k by k, both stacks side by side, so a cut by the time budget cuts both alike
        for k in every:
            row = result["cells"].setdefault(f"every {k}", {})
            if time.perf_counter() - t_start > budget_s:
                row["skipped"] = "time budget"
                print(f"| every {k} | skipped (time budget) |", flush=True)
                continue
            n = max(2 * k, steps if k > 1 else 4)  # every step: a few saves say enough
            again = run(None, None, n)
            for stack in stacks:
                try:
                    t = cell(stack, k, n)
                    row[stack["name"]] = {"step_s": t, "base_s": again, "overhead": t / again - 1}
                    text = f"{(t / again - 1) * 100:+.2f}%"
                except (Exception, torch.distributed.checkpoint.api.CheckpointException) as e:
                    row[stack["name"]] = {"error": repr(e)}
                    text = f"failed: {e!r:.120}"
                print(f"| every {k} | {stack['name']} | {text} |", flush=True)
            emit(result)
    finally:
        for stack in stacks:
            stack["stager"].close()
    return result


def fit_to_memory(params_m: float, out_dir: str) -> float:
    """``params_m``, lowered so two stagers' copies (12 B per parameter each) fit in /dev/shm
    and two checkpoints on the disk under ``out_dir``, with room to spare."""
    ckpt = params_m * 1e6 * 12
    st = os.statvfs("/dev/shm")
    shm = st.f_bavail * st.f_frsize
    disk = shutil.disk_usage(out_dir).free
    fit = min(1.0, shm / (2.5 * ckpt), disk / (2.5 * ckpt))
    if fit < 1.0:
        print(f"# /dev/shm {shm / GiB:.0f} GiB, disk {disk / GiB:.0f} GiB free: training "
              f"{params_m * fit:.0f}M parameters instead of {params_m:.0f}M", flush=True)
    return params_m * fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size-gib", type=float, default=12.0)
    ap.add_argument("--layers", type=int, default=64, help="part A: 48 tensors per layer")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--params-m", type=float, default=1000.0, help="part B model size")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=300.0, help="part B's time budget")
    ap.add_argument("--every", default="5,20,1", help="part B intervals, in this order")
    ap.add_argument("--dir", default=None, help="part B checkpoint directory (a local disk)")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "none"
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "gpu": gpu, "args": vars(args)}
    print(f"# {meta}", flush=True)
    out: dict[str, Any] = {"meta": meta}

    def emit(training: dict[str, Any] | None = None) -> None:
        if training is not None:
            out["training"] = training
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1, default=str)

    # `timeout` sends SIGTERM: end through the finally below, which keeps the results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    out_dir = tempfile.mkdtemp(prefix="dcpp-gpu-bench-", dir=args.dir)
    code = 0
    try:
        with single_rank_world():
            if not args.skip_a:
                out["staging"] = part_a(args.size_gib, args.layers, args.saves, args.device)
                emit()
            if not args.skip_b:
                part_b(
                    args.params_m, args.steps, tuple(int(e) for e in args.every.split(",")),
                    out_dir, args.device, args.batch, args.seq, args.budget_s, emit)
    except BaseException as e:  # noqa: BLE001 - report, keep the results, and do not hang
        traceback.print_exc()
        out["error"] = repr(e)
        code = 124 if isinstance(e, SystemExit) else 1
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        emit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a dead PROCESS-executor daemon leaves DCP's thread waiting forever


if __name__ == "__main__":
    main()
