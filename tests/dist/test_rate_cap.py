"""Shaped bursts in a real 2-rank gloo job: each rank's data write stays under its
``max_bytes_per_s``, rank 1's persist starts ``stagger`` seconds late without holding up its
trainer, and the checkpoints load bit-exact.

The rate checks are lower bounds on time (``(B - GRANT) / cap`` for ``B`` bytes), which a
loaded machine only makes easier to meet: they fail only if the cap lets bytes through early.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_plus import LocalReader, LocalWriter, SafeLoadPlanner
from dcp_plus.stagers import ArenaStager
from dcp_plus.storage.rate import GRANT
from dcp_plus.shm import SHM_DIR
from tools.testkit.exact import assert_bit_exact
from tools.testkit.world import assert_case_ok, run_world

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20
CAP = 64 * MiB
"""Per rank, bytes per second: each rank writes 64 MiB in >= 0.94 s."""
PER_RANK = 64 * MiB
STAGGER = 2.0
THIS = "tests.dist.test_rate_cap"


def rank_state(rank: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(40 + rank)
    return {f"rank{rank}.w": torch.randn(nbytes // 4, generator=g),
            f"rank{rank}.odd": torch.randint(0, 255, (4095,), dtype=torch.uint8, generator=g)}


def _data_files(path: str, rank: int) -> list[str]:
    return [os.path.join(path, n) for n in os.listdir(path)
            if n.startswith(f"__{rank}_") and n.endswith(".dcpp")]


def _save(sd: dict[str, torch.Tensor], writer: LocalWriter, arena: bool) -> float:
    """Save ``sd``; returns when the trainer's part was done (``time.time()``)."""
    warnings.filterwarnings("ignore")
    if not arena:
        dcp.save(sd, storage_writer=writer)
        return time.time()
    stager = ArenaStager()
    try:
        resp = dcp.async_save(sd, storage_writer=writer, async_stager=stager)
        resp.staging_completion.result()
        returned = time.time()
        resp.upload_completion.result()
    finally:
        stager.close()
    return returned


def _capped(rank: int, path: str, arena: bool) -> dict[str, Any]:
    sd = rank_state(rank, PER_RANK)
    writer = LocalWriter(path, max_bytes_per_s=CAP)
    dist.barrier()
    t0 = time.monotonic()
    _save(sd, writer, arena)
    wall = time.monotonic() - t0
    p = writer.last_persist
    assert p is not None
    return {"write_s": p.write_s, "wall_s": wall, "data_bytes": p.data_bytes,
            "file_bytes": sum(os.path.getsize(f) for f in _data_files(path, rank)),
            "buckets_left": [n for n in os.listdir(SHM_DIR)
                             if n.startswith(f"dcpp-{os.getpid()}-rate-")]}


def capped_dcp_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """Plain ``dcp.save``: every byte through this process's threads (bounce buffers)."""
    return _capped(rank, path, arena=False)


def capped_arena(rank: int, world: int, path: str) -> dict[str, Any]:
    """``async_save`` with the ArenaStager: slab data through the worker processes."""
    return _capped(rank, path, arena=True)


def staggered(rank: int, world: int, path: str) -> dict[str, Any]:
    sd = rank_state(rank, 4 * MiB)
    writer = LocalWriter(path, stagger=STAGGER)
    dist.barrier()
    t0 = time.time()
    returned = _save(sd, writer, arena=True)
    p = writer.last_persist
    assert p is not None
    return {"t0": t0, "returned": returned, "writing": p.writing,
            "first_mtime": min(os.stat(f).st_mtime for f in _data_files(path, rank))}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    work = tmp_path_factory.mktemp("rate")
    cases = [(f"{THIS}:{name}", {"path": str(work / name)})
             for name in ("capped_dcp_save", "capped_arena", "staggered")]
    return work, run_world(2, cases, work / "logs")


@pytest.mark.parametrize("case", ["capped_dcp_save", "capped_arena"])
def test_each_rank_writes_under_its_cap_and_loads_bit_exact(world, case):
    work, results = world
    for r in assert_case_ok(results, case):
        b = r["file_bytes"]
        assert r["data_bytes"] == b >= PER_RANK
        floor = (b - GRANT) / CAP  # the bucket's bound: rate <= CAP * b / (b - GRANT)
        assert r["write_s"] >= floor, f"{b} bytes in {r['write_s']:.3f} s: over {CAP} B/s"
        assert r["wall_s"] >= floor
        assert b / r["write_s"] <= CAP * (1 + GRANT / (b - GRANT))
        assert r["buckets_left"] == []
    expected = {**rank_state(0, PER_RANK), **rank_state(1, PER_RANK)}
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=LocalReader(work / case), planner=SafeLoadPlanner(),
             no_dist=True)
    assert_bit_exact(out, expected)


def test_rank_1_starts_writing_a_stagger_late_without_blocking_its_trainer(world):
    work, results = world
    rank0, rank1 = assert_case_ok(results, "staggered")
    assert rank1["writing"] >= rank1["t0"] + STAGGER
    assert rank1["first_mtime"] >= rank1["t0"] + STAGGER - 0.02  # file times tick coarsely
    # async_save gave the trainer back its thread before the stagger ran out: had the wait
    # been on that thread, it would have returned only after the write had begun
    assert rank1["returned"] < rank1["writing"]
    assert rank0["writing"] < rank1["writing"]
    expected = {**rank_state(0, 4 * MiB), **rank_state(1, 4 * MiB)}
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=LocalReader(work / "staggered"), planner=SafeLoadPlanner(),
             no_dist=True)
    assert_bit_exact(out, expected)
