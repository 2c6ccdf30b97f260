"""Staging benchmark: ArenaStager vs DCP's stagers vs the memcpy limit, and training overhead.

Run: ``python -m benchmarks.staging [--size-gib 2] [--quick]``.

Part A stages a GPT-2-like model + AdamW state dict (bf16 weights, fp32 moments, ~1,200
tensors) through ``dcp.async_save`` several times and reports, per save, the blocking time
(call to return) and the time until staging completes. Persistence goes to a writer that
discards the bytes, so only staging is timed. The limit is one ``copy_`` of the same number of
bytes into a pre-faulted shared-memory buffer.

Part B runs a small CPU training loop (AdamW) and checkpoints every 1, 5 and 20 steps to local
disk with DCP's ``FileSystemWriter``, reporting step-time overhead against no checkpointing.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import (
    BlockingAsyncStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from dcp_plus import LocalWriter
from dcp_plus._compat.torch_dcp import ReusableDefaultStager
from dcp_plus.cli.bench.limits import MemcpyLimit
from dcp_plus.format.layout import align_up
from dcp_plus.stagers import ArenaStager
from tools.testkit.world import single_rank_world

MiB = 1 << 20
GiB = 1 << 30


class NullWriter(StorageWriter):
    """A storage writer that accepts every item and stores nothing (times staging only)."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        from dcp_plus._compat.torch_dcp import storage_info

        results = [
            WriteResult(
                index=MetadataIndex(item.index.fqn, item.index.offset, item.index.index),
                size_in_bytes=0,
                storage_data=storage_info()("null", 0, 0),
            )
            for item in plan.items
        ]
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def gpt2_like_state_dict(
    size_bytes: int, layers: int = 25, device: str = "cpu"
) -> dict[str, Any]:
    """bf16 weights + fp32 AdamW moments + step tensors: 12 params/layer, 4 tensors each.

    Weights and moments live on ``device``; the ``step`` counters on CPU, as AdamW keeps them.
    """
    # bytes per parameter: 2 (bf16 weight) + 4 + 4 (exp_avg, exp_avg_sq)
    d = int(math.sqrt(size_bytes / (10 * 12 * layers)))
    d -= d % 8
    shapes = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.c_attn.weight": (3 * d, d),
        "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d),
        "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (4 * d, d),
        "mlp.c_fc.bias": (4 * d,),
        "mlp.c_proj.weight": (d, 4 * d),
        "mlp.c_proj.bias": (d,),
    }
    model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    for i in range(layers):
        for name, shape in shapes.items():
            fqn = f"h.{i}.{name}"
            model[fqn] = torch.randn(shape, device=device).to(torch.bfloat16)
            state[fqn] = {
                "step": torch.tensor(10.0),
                "exp_avg": torch.randn(shape, device=device),
                "exp_avg_sq": torch.rand(shape, device=device),
            }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def state_bytes(sd: Any) -> tuple[int, int]:
    n = b = 0
    stack = [sd]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            n += 1
            b += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return n, b


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def time_saves(
    sd: dict[str, Any],
    stager: Any,
    saves: int,
    kind: AsyncCheckpointerType,
    limit: MemcpyLimit,
) -> list[tuple[float, float, float]]:
    out = []
    for _ in range(saves):
        lim = limit.measure()  # the VM's memory bandwidth drifts: re-measure next to each save
        t0 = time.perf_counter()
        resp = dcp.async_save(
            sd, storage_writer=NullWriter(), async_stager=stager, async_checkpointer_type=kind
        )
        t1 = time.perf_counter()
        if isinstance(resp, Future):  # staged synchronously inside async_save
            t2 = t1
            resp.result()
        else:
            resp.staging_completion.result()
            t2 = time.perf_counter()
            resp.upload_completion.result()
        out.append((t1 - t0, t2 - t0, lim))
        del resp
        gc.collect()
    return out


def part_a(size_gib: float, saves: int) -> None:
    sd = gpt2_like_state_dict(int(size_gib * GiB))
    n, nbytes = state_bytes(sd)
    limit = MemcpyLimit(nbytes)
    print(f"## Part A: {n} tensors, {nbytes / GiB:.2f} GiB")
    print("| stager | executor | save | blocking ms | staged ms | limit ms | staged / limit |")
    print("|---|---|---|---|---|---|---|")
    T, P = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS
    cases: list[tuple[str, Callable[[], Any], AsyncCheckpointerType]] = [
        ("ArenaStager", lambda: ArenaStager(), T),
        ("ArenaStager", lambda: ArenaStager(), P),
        ("ArenaStager+prefault", lambda: _prefaulted(sd), T),
        ("ArenaStager+reserve", lambda: _reserved(sd), T),
        ("async_save default", lambda: None, T),
        (
            "DefaultStager(F,T,T,F)",
            lambda: ReusableDefaultStager(StagingOptions(False, True, True, False)),
            P,
        ),
        ("BlockingAsyncStager", lambda: BlockingAsyncStager(), T),
    ]
    for name, make, kind in cases:
        shm0 = shmem_bytes()
        stager = make()
        rows = time_saves(sd, stager, saves, kind, limit)
        extra = shmem_bytes() - shm0
        for i, (blk, stg, lim) in enumerate(rows, 1):
            print(
                f"| {name} | {kind.value} | {i} | {blk * 1e3:.1f} | {stg * 1e3:.0f} | "
                f"{lim * 1e3:.0f} | {stg / lim:.2f}x |"
            )
        if isinstance(stager, ArenaStager):
            print(
                f"| {name} | {kind.value} | steady extra memory | {stager.nbytes / nbytes:.3f}x "
                f"state (arena) | {extra / nbytes:.3f}x (Shmem delta) | | |"
            )
        if stager is not None:
            stager.close()
        del stager
        gc.collect()
    limit.close()


def _prefaulted(sd: dict[str, Any]) -> ArenaStager:
    """What ``guard()`` does after the first optimizer step: pre-fault the estimated bytes."""
    s = ArenaStager()
    tensors = [t for t in _leaves(sd) if isinstance(t, torch.Tensor)]
    s.prefault(sum(align_up(max(t.nbytes, 1)) for t in tensors)).result()
    return s


def _leaves(v: Any) -> list[Any]:
    if isinstance(v, dict):
        return [x for w in v.values() for x in _leaves(w)]
    if isinstance(v, (list, tuple)):
        return [x for w in v for x in _leaves(w)]
    return [v]


def _tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in _leaves(sd) if isinstance(v, torch.Tensor)]


def _reserved(sd: dict[str, Any]) -> ArenaStager:
    s = ArenaStager()
    s.reserve(sd)
    return s


class Net(torch.nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def part_b(
    params_m: float,
    steps: int,
    out_dir: str,
    intervals: tuple[int, ...] = (1, 5, 20),
    only: tuple[str, ...] = (),
    pairs: int = 3,
) -> None:
    layers = 8
    d = int(math.sqrt(params_m * 1e6 / (8 * layers)))
    torch.manual_seed(0)
    model = Net(d, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, d)
    nparams = sum(p.numel() for p in model.parameters())

    def step(before_update: Callable[[], Any] | None = None) -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        if before_update is not None:
            before_update()
        opt.step()

    for _ in range(3):
        step()

    def run(
        every: int | None,
        stager: Any = None,
        writer: Callable[[str], Any] = dcp.FileSystemWriter,
        kind: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
        guarded: bool = False,
        nsteps: int = steps,
    ) -> float:
        pending: list[Any] = []
        dirs: list[str] = []  # checkpoints written, oldest first (LocalWriter never overwrites)
        times: list[float] = []
        for i in range(nsteps):
            t = time.perf_counter()
            if every and i % every == 0:
                dirs.append(os.path.join(out_dir, f"{len(times)}-{i}-{time.monotonic_ns()}"))
                resp = dcp.async_save(
                    {"model": model.state_dict(), "optim": opt.state_dict()},
                    storage_writer=writer(dirs[-1]),
                    async_stager=stager,
                    async_checkpointer_type=kind,
                )
                if not isinstance(resp, Future):
                    if not guarded:
                        resp.staging_completion.result()  # no guard: wait before the update
                    pending.append(resp.upload_completion)
                else:
                    pending.append(resp)
                while len(pending) > 1:
                    pending.pop(0).result()
            step()
            times.append(time.perf_counter() - t)
            while len(dirs) > len(pending) + 1:  # retention, outside the timed step
                shutil.rmtree(dirs.pop(0), ignore_errors=True)
        for f in pending:
            f.result()
        return statistics.mean(times)

    limit_dst: list[torch.Tensor] = []

    def run_limit(every: int, nsteps: int = steps) -> float:
        """The floor of any host-memory snapshot: every ``every`` steps one thread copies the
        model and optimizer tensors into pre-faulted buffers (one GIL-free ``_foreach_copy_``)
        while the step's forward and backward run, and the update waits for it. Nothing is
        persisted."""
        src = _tensors({"model": model.state_dict(), "optim": opt.state_dict()})
        if not limit_dst:  # allocated once, as a stager reuses its buffers: a fresh 1.2 GB
            # per block makes the kernel's page freeing and zeroing land in the steps
            limit_dst.extend(torch.zeros_like(t) for t in src)  # zeros: pre-faulted
        dst = limit_dst
        times: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            for i in range(nsteps):
                t = time.perf_counter()
                wait = None
                if i % every == 0:
                    wait = pool.submit(torch._foreach_copy_, dst, src).result
                step(wait)
                times.append(time.perf_counter() - t)
        return statistics.mean(times)

    print(
        f"\n## Part B: {nparams / 1e6:.0f}M params ({nparams * 12 / 1e9:.2f} GB checkpoint: "
        f"fp32 weights + AdamW moments), AdamW; step-time overhead vs no checkpointing, "
        f"{pairs} pairs of {steps}-step blocks per cell"
    )
    print(
        "| stager | writer | executor | "
        + " | ".join(f"every {e}: median (each pair)" for e in intervals)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(intervals))
    fsw: Callable[[str], Any] = dcp.FileSystemWriter
    T, P = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS
    makers: list[tuple[str, Callable[[], Any] | None, str, Callable[[str], Any], Any]] = [
        ("ArenaStager (guard)", lambda: ArenaStager(), "LocalWriter", LocalWriter, T),
        ("ArenaStager (guard)", lambda: ArenaStager(), "FileSystemWriter", fsw, T),
        ("async_save default", None, "FileSystemWriter", fsw, T),
        ("BlockingAsyncStager", lambda: BlockingAsyncStager(), "FileSystemWriter", fsw, T),
        (
            "DefaultStager(F,T,T,F)",
            lambda: ReusableDefaultStager(StagingOptions(False, True, True, False)),
            "FileSystemWriter",
            fsw,
            P,
        ),
    ]
    def overhead(block: Callable[[], float]) -> str:
        """Step-time overhead of ``block`` as a table cell. The VM's speed drifts by tens of
        percent within a minute, so the figure is the median over ``pairs`` of (the block /
        a no-checkpoint block right before it), with each pair's value in brackets."""
        ratios = []
        for _ in range(pairs):
            base = run(None, None)
            ratios.append(block() / base)
        med = statistics.median(ratios)
        spread = ", ".join(f"{(r - 1) * 100:+.0f}" for r in ratios)
        return f"{(med - 1) * 100:+.1f}% ({spread})"

    if not only or any(o in "memcpy limit" for o in only):
        cells = [overhead(functools.partial(run_limit, every)) for every in intervals]
        print("| memcpy limit (snapshot copy only, no persist) | – | – | " + " | ".join(cells)
              + " |", flush=True)
        limit_dst.clear()
    for name, make, wname, writer, kind in makers:
        if only and not any(o in f"{name} {wname}" for o in only):
            continue
        # One stager per row, as in a training job; its first (cold) save is a warm-up, not
        # measured (the first-save cost is part A's subject).
        stager = make() if make else None
        guard = stager.guard(opt) if isinstance(stager, ArenaStager) else None
        try:
            run(1, stager, writer, kind, guard is not None, nsteps=2)
        except (Exception, torch.distributed.checkpoint.api.CheckpointException) as e:
            print(f"| {name} | {wname} | {kind.value} | warm-up failed: {e!r:.80} |", flush=True)
            continue
        cells = []
        for every in intervals:
            try:
                cells.append(overhead(
                    functools.partial(run, every, stager, writer, kind, guard is not None)))
            except (Exception, torch.distributed.checkpoint.api.CheckpointException) as e:
                # one broken stager must not hide the other rows (DCP raises a BaseException)
                cells.append(f"failed: {type(e).__name__}")
        print(f"| {name} | {wname} | {kind.value} | " + " | ".join(cells) + " |", flush=True)
        if guard is not None:
            guard.remove()
        if stager is not None:
            stager.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--params-m", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB, 25M params, 20 steps")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--every", default="1,5,20", help="part B checkpoint intervals")
    ap.add_argument("--only", default="", help="part B rows whose name contains one of these")
    args = ap.parse_args()
    if args.quick:
        args.size_gib, args.params_m, args.steps, args.saves = 0.25, 25.0, 20, 3
    import warnings

    warnings.filterwarnings("ignore")
    print(
        f"# machine: {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )
    out_dir = tempfile.mkdtemp(prefix="dcpp-bench-", dir=os.path.expanduser("~"))
    try:
        with single_rank_world():
            if not args.skip_a:
                part_a(args.size_gib, args.saves)
            if not args.skip_b:
                part_b(
                    args.params_m,
                    args.steps,
                    out_dir,
                    tuple(int(e) for e in args.every.split(",")),
                    tuple(o for o in args.only.split(",") if o),
                )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    sys.stdout.flush()
    # A stock DCP PROCESS save whose daemon died leaves an executor thread waiting forever
    # (seen with DefaultStager(F,T,T,F) + FileSystemWriter at 1.2 GB): do not hang on exit.
    os._exit(0)


if __name__ == "__main__":
    main()
