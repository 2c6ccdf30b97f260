"""Launch a 2-rank TorchTitan training job on CPU (gloo) as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tools.testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[3]


def run_titan(args: list[str], workdir: Path, *, world: int = 2, env: dict[str, str] | None = None,
              timeout: float = 240, name: str = "run") -> list[int]:
    """Run ``python -m tools.testkit.titan.rank ARGS`` on ``world`` ranks; return exit codes.

    Each rank's output goes to ``workdir/NAME.rankR.log``.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ)
    base.update(env or {})
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                HF_HOME=str(workdir / "hf_home"), TORCHINDUCTOR_CACHE_DIR=str(workdir / "ind"))
    procs = []
    for r in range(world):
        with open(workdir / f"{name}.rank{r}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tools.testkit.titan.rank", *args],
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=workdir,
                stdout=log, stderr=subprocess.STDOUT))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def titan_job(root: Path, name: str, config: str, dump: Path, extra: list[str],
              env: dict[str, str] | None = None, *, steps: int = 12,
              interval: int = 3) -> list[int]:
    """One 2-rank job of recipe ``config`` (``tools.testkit.titan.recipe``) on the tokenizer
    and dataset under ``root`` (``root/tokenizer``, ``root/data``), dumping into ``dump``;
    its losses and saves go to ``root/NAME.losses.jsonl`` and ``root/NAME.saves.jsonl``."""
    args = ["--module", "tools.testkit.titan.recipe", "--config", config,
            "--hf_assets_path", str(root / "tokenizer"),
            "--dataloader.dataset_path", str(root / "data"),
            "--dump_folder", str(dump), "--training.steps", str(steps),
            "--checkpoint.interval", str(interval), *extra]
    env = {"DCPP_TITAN_LOSSES": str(root / f"{name}.losses.jsonl"),
           "DCPP_TITAN_SAVES": str(root / f"{name}.saves.jsonl"), **(env or {})}
    return run_titan(args, root, env=env, name=name)


def log_tail(workdir: Path, name: str, world: int = 2, lines: int = 40) -> str:
    out = []
    for r in range(world):
        text = (workdir / f"{name}.rank{r}.log").read_text(errors="replace").splitlines()
        out.append(f"--- {name} rank {r} ---\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file the rank hooks write (none if it is missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_of(path: Path) -> dict[int, float]:
    """Rank 0's logged loss per step (``$DCPP_TITAN_LOSSES``)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path)}


def committed_steps(folder: Path) -> list[int]:
    """The ``step-N`` folders of a local checkpoint folder with a commit record."""
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")
                  if (p / ".metadata").exists())
