"""Save blocking time in a real TorchTitan loop: TorchTitan's async modes vs dcp_plus.

Runs the CPU test recipe (llama3 debug model, FSDP over 2 gloo ranks; see
``tools/testkit/titan/recipe.py`` and the shims in ``tools/testkit/titan/rank.py``) once per mode,
all in one invocation, and reports per save the time ``CheckpointManager.save()`` held the
loop plus the time the next ``maybe_wait_for_staging()`` (before ``optimizer.step()``) waited,
the slower rank of each save counted, and the wall time of the step after a save against the
other steps (on a small machine most of a save's cost is there: the background write
competes with training for the cores)::

    python -m benchmarks.torchtitan --steps 40 --interval 5

Needs ``dcp-plus[torchtitan]``. ``async_with_pinned_mem`` needs CUDA (DCP's pinned staging
asserts an accelerator): on a CPU-only machine it is attempted and reported as failed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tools.testkit.titan.assets import make_dataset, make_tokenizer
from tools.testkit.titan.run import log_tail, read_jsonl, run_titan

MODES = {
    "torchtitan async": ("stock_cpu", ["--checkpoint.async_mode", "async"]),
    "torchtitan async_with_pinned_mem": ("stock_cpu",
                                         ["--checkpoint.async_mode", "async_with_pinned_mem"]),
    "dcp_plus async": ("stock_cpu", ["--override.imports",
                                     "dcp_plus.integrations.torchtitan.use_dcp_plus",
                                     "--checkpoint.async_mode", "async"]),
    "dcp_plus async, stager_buffers=2": (
        "stock_cpu", ["--override.imports",
                      'dcp_plus.integrations.torchtitan.use_dcp_plus={"stager_buffers": 2}',
                      "--checkpoint.async_mode", "async"]),
    "dcp_plus async, memory tier (durable_every=4)": (
        "stock_cpu", ["--override.imports",
                      'dcp_plus.integrations.torchtitan.use_dcp_plus={"memory_tier": true, '
                      '"durable_every": 4}', "--checkpoint.async_mode", "async"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    args = ap.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="titan-bench-"))
    tok, data = make_tokenizer(root / "tokenizer"), make_dataset(root / "data", documents=2000)
    print("| mode | saves | first save ms | later saves: median ms | max ms | "
          "staging wait ms (median) | step after a save vs other steps, ms (median) |\n"
          "|---|---|---|---|---|---|---|")
    for i, mode in enumerate(args.modes):
        config, extra = MODES[mode]
        name = f"m{i}"
        saves = root / f"{name}.saves.jsonl"
        cmd = ["--module", "tools.testkit.titan.recipe", "--config", config,
               "--hf_assets_path", str(tok), "--dataloader.dataset_path", str(data),
               "--dump_folder", str(root / name), "--training.steps", str(args.steps),
               "--checkpoint.interval", str(args.interval), "--checkpoint.keep_latest_k", "3",
               *extra]
        losses = root / f"{name}.losses.jsonl"
        codes = run_titan(cmd, root, env={"DCPP_TITAN_SAVES": str(saves),
                                          "DCPP_TITAN_LOSSES": str(losses)}, name=name,
                          timeout=900)
        if codes != [0, 0]:
            tail = log_tail(root, name, lines=6).splitlines()
            why = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1])
            print(f"| {mode} | failed: `{why.strip()[:120]}` | | | | |")
            continue
        per_step: dict[int, list[dict]] = {}
        for r in read_jsonl(saves):
            if not r["last"]:
                per_step.setdefault(r["step"], []).append(r)
        steps = sorted(per_step)
        block = [1e3 * max(r["blocking_s"] for r in per_step[s]) for s in steps]
        wait = [1e3 * max(r["staging_wait_s"] for r in per_step[s]) for s in steps]
        later = block[1:] or block
        after, other = step_times(losses, set(steps))
        print(f"| {mode} | {len(steps)} | {block[0]:.1f} | {statistics.median(later):.1f} | "
              f"{max(later):.1f} | {statistics.median(wait):.2f} | "
              f"{statistics.median(after):.0f} vs {statistics.median(other):.0f} |")


def step_times(losses: Path, saved: set[int]) -> tuple[list[float], list[float]]:
    """Wall ms from one logged step to the next (rank 0), split into those that follow a
    save (the save call, then a step beside the background persist) and the others. The
    first save and the steps before it (warm-up) are left out."""
    t = {r["step"]: r["t"] for r in read_jsonl(losses)}
    first = min(saved)
    after, other = [], []
    for s in sorted(t):
        if s - 1 in t and s - 1 > first:
            (after if s - 1 in saved else other).append(1e3 * (t[s] - t[s - 1]))
    return after or [float("nan")], other or [float("nan")]


if __name__ == "__main__":
    main()
