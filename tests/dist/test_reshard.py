"""Sharded DTensors saved by 4 gloo ranks load bit-exact at 4 and at 2 ranks (resharding).

One 4-rank world saves and loads at 4 ranks; one 2-rank world then loads the same checkpoint.
The functions without a ``test_`` prefix are cases that run inside those worlds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.testkit.world import assert_case_ok, run_world

THIS = "tests.dist.test_reshard"
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]
SLAB_ROWS_PER_RANK = 256


def full_tensors() -> dict[str, torch.Tensor]:
    """The full (unsharded) values, identical on every rank. 10 rows and 6 columns split
    unevenly over 4 ranks (3,3,3,1 rows; 2,2,2,0 columns: one rank holds an empty shard)."""
    from tests.conftest import random_tensor

    gen = torch.Generator().manual_seed(1234)
    out = {str(d).removeprefix("torch."): random_tensor((10, 6), d, gen) for d in DTYPES}
    out["wide"] = random_tensor((3, 1000), torch.float32, gen)
    return out


def _slabbed_full(world: int) -> torch.Tensor:
    return torch.arange(world * SLAB_ROWS_PER_RANK * 64, dtype=torch.float32).reshape(-1, 64)


def _expected_local(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    chunks = full.chunk(world, dim)  # DTensor's Shard(dim) split
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _sharded(full: dict[str, torch.Tensor], mesh: Any, dim_of: dict[str, int]) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {name: distribute_tensor(t, mesh, [Shard(dim_of[name])]) for name, t in full.items()}


# ---------------------------------------------------------------------------------------------
# Cases (run inside the worlds)


def save_sharded(rank: int, world: int, path: str) -> dict[str, Any]:
    """Shard(0) for most tensors, Shard(1) for 'wide'; one tensor lives in a registered slab."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from dcp_plus import LocalWriter
    from dcp_plus.memory.slabs import Slab, registry
    from dcp_plus.writers import shutdown_pool
    from tests.conftest import worker_pids

    mesh = _mesh(world)
    full = full_tensors()
    model = _sharded(full, mesh, {n: 1 if n == "wide" else 0 for n in full})
    local = _expected_local(_slabbed_full(world), 0, rank, world)
    slab = Slab(local.nbytes)
    registry.register(slab)
    try:
        in_slab = slab.tensor().view(torch.float32).reshape(local.shape)
        in_slab.copy_(local)
        slabbed = DTensor.from_local(in_slab, mesh, [Shard(0)], run_check=False)
        sd = {"model": model, "slabbed": slabbed, "replicated": full["float64"].clone(),
              "step": 42, "tag": "run-α"}
        dcp.save(sd, storage_writer=LocalWriter(path))
        workers = len(worker_pids())
        del in_slab, slabbed, sd
    finally:
        registry.unregister(slab)
        shutdown_pool()
        slab.close()
    own = sorted(p.name for p in Path(path).glob(f"__{rank}_*.dcpp"))
    return {"files": own, "workers": workers}


def _load_and_check(rank: int, world: int, path: str, swap: bool) -> dict[str, Any]:
    """Load into DTensors sharded over ``world`` ranks (dims swapped if ``swap``) and compare
    every local shard bit-exact with the same region of the full tensor."""
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalReader, SafeLoadPlanner
    from tests.conftest import assert_bit_exact

    mesh = _mesh(world)
    full = full_tensors()
    dims = {n: (1 if n == "wide" else 0) ^ int(swap) for n in full}
    zeros = {n: torch.zeros_like(t) for n, t in full.items()}
    target = {"model": _sharded(zeros, mesh, dims),
              "slabbed": _sharded({"s": torch.zeros_like(_slabbed_full(4))}, mesh,
                                  {"s": int(swap)})["s"],
              "replicated": torch.zeros(10, 6, dtype=torch.float64), "step": 0, "tag": ""}

    dcp.load(target, storage_reader=LocalReader(path), planner=SafeLoadPlanner())

    for name, t in full.items():
        assert_bit_exact(target["model"][name].to_local(),
                         _expected_local(t, dims[name], rank, world), f"model.{name}")
        # and reassembled by DTensor itself (an all-gather over the loaded shards)
        assert_bit_exact(target["model"][name].full_tensor(), t, f"model.{name} (full)")
    assert_bit_exact(target["slabbed"].to_local(),
                     _expected_local(_slabbed_full(4), int(swap), rank, world), "slabbed")
    assert_bit_exact(target["replicated"], full["float64"], "replicated")
    assert (target["step"], target["tag"]) == (42, "run-α")
    return {"shape": list(target["model"]["float32"].to_local().shape)}


def load_same_layout(rank: int, world: int, path: str) -> dict[str, Any]:
    return _load_and_check(rank, world, path, swap=False)


def load_swapped_layout(rank: int, world: int, path: str) -> dict[str, Any]:
    return _load_and_check(rank, world, path, swap=True)


def save_without_collectives_is_refused(rank: int, world: int, path: str) -> bool:
    """Every rank would commit a record of its own items only: LocalWriter refuses."""
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalWriter
    from dcp_plus.errors import CheckpointFormatError

    try:
        dcp.save({f"rank{rank}": torch.ones(2)}, storage_writer=LocalWriter(path),
                 use_collectives=False)
    except CheckpointFormatError as e:
        assert "use_collectives=True" in str(e)
    else:
        raise AssertionError("save with use_collectives=False was accepted")
    return (Path(path) / ".metadata").exists()


def overwrite_sharded(rank: int, world: int, path: str) -> list[str]:
    """Two sharded saves into one directory: the second replaces the first on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_plus import LocalReader, LocalWriter
    from tests.conftest import assert_bit_exact

    mesh = _mesh(world)
    v1, v2 = torch.arange(40.0).reshape(8, 5), -torch.arange(40.0).reshape(8, 5)
    dcp.save({"w": distribute_tensor(v1, mesh, [Shard(0)])}, storage_writer=LocalWriter(path))
    dcp.save({"w": distribute_tensor(v2, mesh, [Shard(0)])},
             storage_writer=LocalWriter(path, overwrite=True))
    target = {"w": distribute_tensor(torch.zeros(8, 5), mesh, [Shard(0)])}
    dcp.load(target, storage_reader=LocalReader(path))
    assert_bit_exact(target["w"].to_local(), _expected_local(v2, 0, rank, world), "w")
    return sorted(p.name for p in Path(path).glob("__*.dcpp"))


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """The checkpoint saved by 4 ranks, and the 4-rank world's case results."""
    work = tmp_path_factory.mktemp("world4")
    path = str(work / "ckpt")
    results = run_world(4, [(f"{THIS}:save_sharded", {"path": path}),
                            (f"{THIS}:load_same_layout", {"path": path}),
                            (f"{THIS}:load_swapped_layout", {"path": path})], work)
    return path, results


def test_four_ranks_save_sharded_dtensors_each_writing_its_own_files(world4):
    path, results = world4
    values = assert_case_ok(results, "save_sharded")

    assert (Path(path) / ".metadata").exists()
    for rank, v in enumerate(values):
        assert v["files"], f"rank {rank} wrote no data file"
        assert v["workers"] == 2, f"rank {rank}: slab shard not written by worker processes"
    all_files = {p.name for p in Path(path).glob("__*.dcpp")}
    assert all_files == {f for v in values for f in v["files"]}


def test_four_rank_checkpoint_loads_bit_exact_at_four_ranks(world4):
    _, results = world4
    assert_case_ok(results, "save_sharded")

    values = assert_case_ok(results, "load_same_layout")

    assert [v["shape"] for v in values] == [[3, 6], [3, 6], [3, 6], [1, 6]]


def test_four_rank_checkpoint_reshards_across_dims_at_four_ranks(world4):
    _, results = world4
    assert_case_ok(results, "save_sharded")

    values = assert_case_ok(results, "load_swapped_layout")

    assert [v["shape"] for v in values] == [[10, 2], [10, 2], [10, 2], [10, 0]]


@pytest.fixture(scope="module")
def world2(world4, tmp_path_factory):
    """A 2-rank world loading the 4-rank checkpoint, plus commit cases."""
    path, results = world4
    assert_case_ok(results, "save_sharded")
    work = tmp_path_factory.mktemp("world2")
    return work, run_world(2, [
        (f"{THIS}:load_same_layout", {"path": path}),
        (f"{THIS}:load_swapped_layout", {"path": path}),
        (f"{THIS}:save_without_collectives_is_refused", {"path": str(work / "nocoll")}),
        (f"{THIS}:overwrite_sharded", {"path": str(work / "overwrite")}),
    ], work)


def test_four_rank_checkpoint_loads_bit_exact_at_two_ranks(world2):
    _, results = world2

    values = assert_case_ok(results, "load_same_layout")

    assert [v["shape"] for v in values] == [[5, 6], [5, 6]]


def test_four_rank_checkpoint_reshards_across_dims_at_two_ranks(world2):
    _, results = world2

    values = assert_case_ok(results, "load_swapped_layout")

    assert [v["shape"] for v in values] == [[10, 3], [10, 3]]


def test_multi_rank_save_without_collectives_is_refused_and_commits_nothing(world2):
    work, results = world2

    values = assert_case_ok(results, "save_without_collectives_is_refused")

    assert values == [False, False]
    assert not (work / "nocoll" / ".metadata").exists()


def test_multi_rank_overwrite_keeps_only_the_new_checkpoints_files(world2):
    work, results = world2

    listing = assert_case_ok(results, "overwrite_sharded")[0]

    record = json.loads((work / "overwrite" / ".metadata").read_text())
    assert set(listing) == {e["file"] for e in record["extents"]}
    assert {name.split("_")[2] for name in listing} == {"0", "1"}  # both ranks' files
