"""A 2-rank gloo job with ``CheckpointManager(incremental=True, delta=True)``: each rank's
save references its own previous extents without reading the base's commit record (a record
as large as the world's), and every rank resumes bit-exact through the chain."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.testkit.world import assert_case_ok, run_world

THIS = "tests.dist.test_incremental_dist"
ROWS = 4096


def _state(rank: int, step: int) -> dict[str, Any]:
    import torch

    from tests.conftest import random_tensor

    gen = torch.Generator().manual_seed(rank)
    emb = random_tensor((ROWS, 256), torch.float32, gen)  # 4 parts of 1 MiB per rank
    for s in range(1, step + 1):  # one row in part (s % 4), so links reference each other
        emb[s % 4 * 1024 + s] += 1.0
    return {f"r{rank}": {"emb": emb}, "step": step}


def chain_then_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Case: saves 1-3; between 2 and 3 rank 0 damages step 2's record (no rank may need
    it to save 3); then a new manager resumes from 3."""
    from dcp_plus.manager import CheckpointManager
    from tests.conftest import assert_bit_exact, clone_state, flip_byte

    with CheckpointManager(root, interval=1, keep_last=None, incremental=True,
                           delta=True) as m:
        for step in (1, 2, 3):
            if step == 3 and rank == 0:
                flip_byte(Path(root) / "step_00000002" / ".metadata", 40)
            m.save(step, _state(rank, step)).result(timeout=120)
    target = clone_state(_state(rank, 0))
    with CheckpointManager(root, read_only=True) as m:
        got = m.load_latest(target)
    assert_bit_exact(target, _state(rank, 3))
    return {"step": got}


def test_ranks_chain_from_their_own_extents_and_resume_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_world(2, [(f"{THIS}:chain_then_resume", {"root": str(root)})], tmp_path)

    assert [v["step"] for v in assert_case_ok(results, "chain_then_resume")] == [3, 3]
    record = json.loads((root / "step_00000003" / ".metadata").read_text())
    assert record["bases"] == ["step_00000001", "step_00000002"]
