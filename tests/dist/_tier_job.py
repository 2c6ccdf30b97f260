"""A gloo job with memory and peer tiers that SIGKILLs itself, and its restart.

Usage: ``python -m tests.dist._tier_job SPEC_JSON RANK``. SPEC: ``world_size``, ``port``,
``root``, ``job_id``, ``mode`` (``train``: save steps 1..``until`` with every rank dying at
``kill_phase`` of step ``until``, or after it when that is ``"after"``; ``until`` 0: save until
killed from outside, each state of ``big`` floats; ``resume``: restore and write ``out`` +
``.RANK.json`` with the step, tiers and whether the state is bit-exact); ``mirrored``: the
explicit ``partner=`` :func:`mirrored` instead of ``rank + ranks_per_node``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from dcp_plus.tiers import names


def expected(rank: int, step: int, big: int = 64 * 1024) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    # per-rank keys: DCP treats equal keys of plain tensors as one replicated tensor
    model = {"w": torch.randn(64, big // 64, generator=g),
             "h": torch.randn(300, generator=g).to(torch.bfloat16),
             "t": torch.randn(16, 8, generator=g).t(), "e": torch.empty(0),
             # strided and over one message: a peer restore gathers it, then copies it
             "T": torch.randn(1100, 1024, generator=g).t()}
    return {"model": {f"{k}{rank}": v for k, v in model.items()},
            "extra": {"step": step, f"rng{rank}": io.BytesIO(b"r%d-%d" % (rank, step))}}


def mirrored(rank: int) -> int:
    """An explicit failure-domain map for 4 ranks: 0 <-> 3, 1 <-> 2."""
    return 3 - rank


def same(a: dict[str, Any], b: dict[str, Any], rank: int) -> bool:
    rng = f"rng{rank}"
    return all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"]) and \
        a["extra"]["step"] == b["extra"]["step"] and \
        a["extra"][rng].getvalue() == b["extra"][rng].getvalue()


def main(spec_path: str, rank_arg: str) -> None:
    import torch.distributed as dist

    from dcp_plus.manager import CheckpointManager

    spec = json.loads(Path(spec_path).read_text())
    rank = int(rank_arg)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world_size"], timeout=timedelta(seconds=60))
    until, kill_phase = spec.get("until", 0), spec.get("kill_phase", "after")
    big = spec.get("big", 64 * 1024)

    def hook(phase: str, step: int) -> None:
        if spec["mode"] == "train" and step == until and phase == kill_phase:
            os.kill(os.getpid(), signal.SIGKILL)

    m = CheckpointManager(spec["root"], memory_tier=True, peer_tier=spec["world_size"] > 1,
                          ranks_per_node=spec.get("ranks_per_node", 1), durable_every=3,
                          job_id=spec["job_id"], takeover=True, keep_last=2, on_phase=hook,
                          interval=1, partner=mirrored if spec.get("mirrored") else None)
    if spec["mode"] == "train":
        start = spec.get("start", 1)
        if start > 1:  # a restarted life: resume first
            state = expected(rank, 0)
            assert m.load_latest(state) == start - 1
        step = start
        inodes: dict[int, int] = {}
        while until == 0 or step <= until:
            m.save(step, expected(rank, step, big)).result(timeout=120)
            if spec.get("inodes"):  # the replica file each step was received into
                (held,) = [f for f in names.listing(spec["job_id"], rank)
                           if f.kind == "replica" and f.step == step]
                inodes[step] = os.stat(held.path).st_ino
                Path(f"{spec['out']}.{rank}.inodes.json").write_text(json.dumps(inodes))
            step += 1
        if spec.get("close_keep"):  # a clean end that keeps the snapshots
            m.close(keep_snapshots=True)
            dist.destroy_process_group()
            return
        os.kill(os.getpid(), signal.SIGKILL)
    state = expected(rank, 0, big)
    step = m.load_latest(state)
    r = m.last_restore
    want = None if step is None else expected(rank, step, big)
    out = {"step": step, "tiers": None if r is None else r.tiers,
           "exact": want is not None and same(state, want, rank),
           "diff": [] if want is None else [k for k, v in want["model"].items()
                                            if not torch.equal(state["model"][k], v)]}
    Path(f"{spec['out']}.{rank}.json").write_text(json.dumps(out))
    m.close(keep_snapshots=spec.get("keep", False))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
