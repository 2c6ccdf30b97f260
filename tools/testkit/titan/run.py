"""Launch a 2-rank TorchTitan training job on CPU (gloo) as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def log_tail(workdir: Path, name: str, world: int = 2, lines: int = 40) -> str:
    out = []
    for r in range(world):
        text = (workdir / f"{name}.rank{r}.log").read_text(errors="replace").splitlines()
        out.append(f"--- {name} rank {r} ---\n" + "\n".join(text[-lines:]))
    return "\n".join(out)
