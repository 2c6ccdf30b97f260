"""A gloo job checkpointing with CheckpointManager; one rank SIGKILLs itself mid-persist.

Usage: ``python -m tests.dist._manager_job SPEC_JSON RANK``. SPEC: ``world_size``, ``port``,
``root``, ``until``, ``victim`` (rank), ``kill_step`` (the victim dies in the persist phase of
that step, once its data files exist). Every rank holds its own tensors (``r{rank}.w``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

EVERY = 2


def expected(rank: int, step: int) -> dict[str, Any]:
    w = torch.full((4096,), float(rank))
    for s in range(1, step + 1):
        w.mul_(0.5).add_(float(s + rank))
    return {f"r{rank}": {"w": w}, "step": step}


def main(spec_path: str, rank_arg: str) -> None:
    import torch.distributed as dist

    from dcp_plus.manager import CheckpointManager
    from dcp_plus.manager.naming import step_dirname

    spec = json.loads(Path(spec_path).read_text())
    rank = int(rank_arg)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world_size"], timeout=timedelta(seconds=60))
    root = spec["root"]

    def hook(phase: str, step: int) -> None:
        if rank == spec["victim"] and phase == "persist" and step == spec["kill_step"]:
            path = os.path.join(root, step_dirname(step))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (
                    os.path.isdir(path) and any(n.endswith(".dcpp") for n in os.listdir(path))):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

    manager = CheckpointManager(root, keep_last=None, interval=EVERY, on_phase=hook,
                                takeover=True)
    state = expected(rank, 0)
    w = state[f"r{rank}"]["w"]
    for step in range(1, spec["until"] + 1):
        w.mul_(0.5).add_(float(step + rank))
        state["step"] = step
        h = manager.maybe_save(step, state)
        if h is not None:
            h.staged.result()  # no optimizer guard here: wait for the snapshot
    manager.close()
    Path(spec["root"], f"finished{rank}").touch()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
