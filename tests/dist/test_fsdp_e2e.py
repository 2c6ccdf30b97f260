"""FSDP2 and HSDP end to end: train, ``dcp.async_save`` with all three dcp_plus plugins while
training continues, load at 4, 2 and 1 ranks, and resume with the same losses.

One 4-rank world trains and saves an FSDP (1-D mesh) and an HSDP (2-D ``("replicate",
"shard")`` mesh) model and loads both back at 4 ranks; one 2-rank world loads both checkpoints
resharded onto a 1-D mesh; the pytest process itself loads them into an unsharded model.
Every rank uses the same global batch, so the forward loss does not depend on the layout and a
loaded checkpoint must reproduce the next step's loss bit for bit. The functions without a
``test_`` prefix are cases that run inside those worlds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.testkit.world import assert_case_ok, run_world

THIS = "tests.dist.test_fsdp_e2e"
LAYOUTS = {"fsdp": [4], "hsdp": [2, 2]}  # mesh shape at 4 ranks

pytestmark = pytest.mark.timeout(300)


def _mesh(shape: list[int]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


# ---------------------------------------------------------------------------------------------
# Cases (run inside the worlds)


def train_and_save(rank: int, world: int, root: str, layout: str,
                   incremental: bool = False) -> dict[str, Any]:
    """Steps 0-1, async save A, step 2 (guarded), async save B, steps 3-4 while B persists.

    Writes the full tensors of the state B snapshotted to ``{root}/{layout}_ref.pt`` (rank 0)
    and returns the losses of steps 3 and 4 and whether save B reused A's plan. With
    ``incremental``, B is an incremental checkpoint on A (its changed parts XOR deltas against
    A's snapshot where smaller, which the stager's second buffer still holds), and both hold
    a frozen sharded table that B references.
    """
    import dataclasses

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_plus import ArenaStager, CachedSavePlanner, LocalWriter
    from tests.dist._fsdp_model import (
        build_model,
        build_optimizer,
        flat_tensors,
        shard,
        state_of,
        train_step,
    )

    model = shard(build_model(seed=0), _mesh(LAYOUTS[layout.removesuffix("_incr")]))
    opt = build_optimizer(model)
    for step in range(2):
        train_step(model, opt, step)
    save_group = dist.new_group(backend="gloo")  # saves run while training uses the default group
    planner = CachedSavePlanner()
    extra = {"frozen": _frozen(_mesh(LAYOUTS["fsdp"]))} if incremental else {}
    writer_a = LocalWriter(f"{root}/{layout}/a", incremental=incremental)
    writer_b = LocalWriter(f"{root}/{layout}/b", **(
        {"base": f"{root}/{layout}/a"} if incremental else {}))
    with ArenaStager(buffers=2 if incremental else 1) as stager:
        stager.guard(opt)
        resp_a = dcp.async_save({**state_of(model, opt), **extra}, planner=planner,
                                async_stager=stager, storage_writer=writer_a,
                                process_group=save_group)
        train_step(model, opt, 2)  # its optimizer.step() waits for snapshot A
        resp_a.upload_completion.result()
        first_hit = planner.last_was_hit

        sd = state_of(model, opt)
        ref = flat_tensors(sd)
        if incremental:
            writer_b.increments = dataclasses.replace(writer_b.increments,
                                                      old=writer_a.last_slabs)
        resp_b = dcp.async_save({**sd, **extra}, planner=planner, async_stager=stager,
                                storage_writer=writer_b, process_group=save_group)
        del sd
        losses = [train_step(model, opt, 3), train_step(model, opt, 4)]
        resp_b.upload_completion.result()
        second_hit = planner.last_was_hit
    if rank == 0:
        torch.save(ref, f"{root}/{layout}_ref.pt")
    return {"losses": losses, "hits": [first_hit, second_hit],
            "local_param_rows": [int(p.to_local().shape[0]) for p in model.parameters()],
            "placements": [str(pl) for pl in next(model.parameters()).placements]}


def _frozen(mesh: Any) -> Any:
    """A 2 MiB table no step changes, sharded by rows (``Shard(0)``) over ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(torch.arange(1 << 19, dtype=torch.float32).reshape(-1, 64), mesh,
                             [Shard(0)])


def load_and_resume(rank: int, world: int, root: str, layout: str, mesh_shape: list[int],
                    steps: int) -> dict[str, Any]:
    """Load checkpoint B of ``layout`` into a freshly initialised model sharded on
    ``mesh_shape``; check it bit-exact against the reference and run ``steps`` more steps."""
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalReader, SafeLoadPlanner
    from tests.conftest import assert_bit_exact
    from tests.dist._fsdp_model import (
        apply_state,
        build_model,
        build_optimizer,
        flat_tensors,
        shard,
        state_of,
        train_step,
    )

    model = shard(build_model(seed=1), _mesh(mesh_shape))
    opt = build_optimizer(model)
    sd = state_of(model, opt)  # DCP's get_state_dict initialises the optimizer state
    extra = {}
    if layout.endswith("_incr"):  # resharded from the base's files, through B's references
        extra["frozen"] = _frozen(_mesh(mesh_shape))
        extra["frozen"].to_local().zero_()
    dcp.load({**sd, **extra}, storage_reader=LocalReader(f"{root}/{layout}/b"),
             planner=SafeLoadPlanner())
    apply_state(model, opt, sd)
    if extra:
        assert_bit_exact(extra["frozen"].full_tensor(), _frozen(_mesh(mesh_shape)).full_tensor(),
                         "frozen")

    got = flat_tensors(state_of(model, opt))
    ref = torch.load(f"{root}/{layout}_ref.pt", weights_only=True)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_bit_exact(got[k], ref[k], k)
    return {"losses": [train_step(model, opt, 3 + i) for i in range(steps)],
            "tensors": len(ref)}


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp4")
    root = str(work / "ckpt")
    Path(root).mkdir()
    # run_world keys results by function name: one small wrapper per layout and world size
    cases = [(f"{THIS}:save_fsdp", {"root": root}), (f"{THIS}:save_hsdp", {"root": root}),
             (f"{THIS}:save_fsdp_incr", {"root": root}),
             (f"{THIS}:load_fsdp_at_4", {"root": root}),
             (f"{THIS}:load_hsdp_at_4", {"root": root})]
    return Path(root), run_world(4, cases, work)


def save_fsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    return train_and_save(rank, world, root, "fsdp")


def save_hsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    return train_and_save(rank, world, root, "hsdp")


def save_fsdp_incr(rank: int, world: int, root: str) -> dict[str, Any]:
    return train_and_save(rank, world, root, "fsdp_incr", incremental=True)


def load_fsdp_incr_at_2(rank: int, world: int, root: str) -> dict[str, Any]:
    return load_and_resume(rank, world, root, "fsdp_incr", [2], steps=1)


def load_fsdp_at_4(rank: int, world: int, root: str) -> dict[str, Any]:
    return load_and_resume(rank, world, root, "fsdp", [4], steps=2)


def load_hsdp_at_4(rank: int, world: int, root: str) -> dict[str, Any]:
    return load_and_resume(rank, world, root, "hsdp", [2, 2], steps=2)


def load_fsdp_at_2(rank: int, world: int, root: str) -> dict[str, Any]:
    return load_and_resume(rank, world, root, "fsdp", [2], steps=1)


def load_hsdp_at_2_as_fsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    return load_and_resume(rank, world, root, "hsdp", [2], steps=1)


@pytest.fixture(scope="module")
def world2(world4, tmp_path_factory):
    root, results = world4
    assert_case_ok(results, "save_fsdp")
    assert_case_ok(results, "save_hsdp")
    work = tmp_path_factory.mktemp("fsdp2")
    return run_world(2, [(f"{THIS}:load_fsdp_at_2", {"root": str(root)}),
                         (f"{THIS}:load_hsdp_at_2_as_fsdp", {"root": str(root)}),
                         (f"{THIS}:load_fsdp_incr_at_2", {"root": str(root)})], work)


def _saved(world4: Any, layout: str) -> tuple[Path, list[dict[str, Any]]]:
    root, results = world4
    return root, assert_case_ok(results, f"save_{layout}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_async_save_while_training_commits_and_reuses_the_plan(world4, layout):
    root, values = _saved(world4, layout)

    for name in ("a", "b"):
        assert (root / layout / name / ".metadata").exists()
    assert [v["hits"] for v in values] == [[False, True]] * 4
    expected = {"fsdp": ["S(0)"], "hsdp": ["R", "S(0)"]}[layout]
    assert all(v["placements"] == expected for v in values), values[0]["placements"]
    # every rank saw the same losses (same global batch) while the saves persisted
    assert len({tuple(v["losses"]) for v in values}) == 1


def test_fsdp_shards_are_uneven_over_four_ranks(world4):
    _, values = _saved(world4, "fsdp")

    # Linear(12, 10).weight: 10 rows as 3,3,3,1; Linear(10, 6).weight: 6 rows as 2,2,2,0
    assert [v["local_param_rows"][0] for v in values] == [3, 3, 3, 1]
    assert [v["local_param_rows"][4] for v in values] == [2, 2, 2, 0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_item_is_stored_once_and_bytes_equal_model_plus_optimizer(world4, layout):
    root, _ = _saved(world4, layout)
    ref = torch.load(root / f"{layout}_ref.pt", weights_only=True)
    record = json.loads((root / layout / "b" / ".metadata").read_text())

    tensors = [e for e in record["extents"] if record["items"][e["fqn"]]["kind"] == "tensor"]
    keys = [(e["fqn"], tuple(e["chunk"])) for e in tensors]
    assert len(keys) == len(set(keys)), "an extent is stored twice"
    assert {e["fqn"] for e in tensors} == set(ref)
    assert sum(e["raw_length"] for e in tensors) == sum(t.nbytes for t in ref.values())
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in ref)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loads_bit_exact_at_four_ranks_and_resumes_with_the_same_losses(world4, layout):
    _, saved = _saved(world4, layout)

    loaded = assert_case_ok(world4[1], f"load_{layout}_at_4")

    assert [v["losses"] for v in loaded] == [v["losses"] for v in saved]


@pytest.mark.parametrize("case,layout", [("load_fsdp_at_2", "fsdp"),
                                         ("load_hsdp_at_2_as_fsdp", "hsdp"),
                                         ("load_fsdp_incr_at_2", "fsdp_incr")])
def test_reshards_bit_exact_at_two_ranks_with_the_same_next_loss(world4, world2, case, layout):
    _, saved = _saved(world4, layout)

    loaded = assert_case_ok(world2, case)

    assert [v["losses"] for v in loaded] == [saved[0]["losses"][:1]] * 2


def test_an_incremental_fsdp_checkpoint_references_what_did_not_change(world4):
    root, saved = _saved(world4, "fsdp_incr")
    record = json.loads((root / "fsdp_incr" / "b" / ".metadata").read_text())

    assert record["version"] == 5 and record["bases"] == ["a"]
    frozen = [e for e in record["extents"] if e["fqn"] == "frozen"]
    assert len(frozen) == 4 and all(e["base"] == "a" for e in frozen)  # each rank's shard
    # the same training as the plain FSDP run: same losses while B persisted
    assert [v["losses"] for v in saved] == [v["losses"] for v in _saved(world4, "fsdp")[1]]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loads_bit_exact_into_an_unsharded_model_in_one_process(world4, layout):
    import torch.distributed.checkpoint as dcp

    from dcp_plus import LocalReader, SafeLoadPlanner
    from tests.conftest import assert_bit_exact
    from tests.dist._fsdp_model import (
        apply_state,
        build_model,
        build_optimizer,
        flat_tensors,
        state_of,
        train_step,
    )

    root, saved = _saved(world4, layout)
    model = build_model(seed=1)
    opt = build_optimizer(model)
    sd = state_of(model, opt)

    dcp.load(sd, storage_reader=LocalReader(root / layout / "b"), planner=SafeLoadPlanner(),
             no_dist=True)
    apply_state(model, opt, sd)

    ref = torch.load(root / f"{layout}_ref.pt", weights_only=True)
    got = flat_tensors(state_of(model, opt))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert_bit_exact(got[k], ref[k], k)
    assert train_step(model, opt, 3) == saved[0]["losses"][0]
