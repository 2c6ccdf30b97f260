"""SafeLoadPlanner's local plan: built directly for tensors read whole, equal to DCP's own
plan in every case, and DCP's planning (and errors) for everything else."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_plus import LocalReader, SafeLoadPlanner
from dcp_plus.planners import whole_reads as whole_reads_module
from tests.conftest import assert_bit_exact, build_state_dict, load, load_target, save


def _planned(state: dict[str, Any], metadata: Metadata,
             **planner_kwargs: Any) -> tuple[SafeLoadPlanner, Any]:
    planner = SafeLoadPlanner(**planner_kwargs)
    planner.set_up_planner(state, metadata, True)
    return planner, planner.create_local_plan()


def _tensor_md(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def test_the_plan_of_a_saved_state_is_built_directly_and_equals_dcps(tmp_path):
    state = build_state_dict()  # every dtype, 0-dim, empty, views, shared storage, values
    save(state, tmp_path / "ckpt")
    metadata = LocalReader(tmp_path / "ckpt").read_metadata()
    planner, plan = _planned(load_target(state), metadata)
    direct = whole_reads_module.whole_reads(planner.state_dict, metadata, True)
    assert direct is not None and len(direct) > 10  # planned here, not by DCP
    assert plan.items == direct
    assert plan.items == create_default_local_load_plan(planner.state_dict, metadata, True).items
    assert_bit_exact(load(load_target(state), tmp_path / "ckpt"), state)


def test_stored_chunks_that_are_not_the_whole_tensor_are_planned_by_dcp():
    metadata = Metadata({
        "halves": _tensor_md([4, 2], [([0, 0], [2, 2]), ([2, 0], [2, 2])]),
        "whole": _tensor_md([3], [([0], [3])]),
        "value": BytesStorageMetadata(),
    })
    state = {"halves": torch.zeros(4, 2), "whole": torch.zeros(3), "value": 0}
    assert whole_reads_module.whole_reads(state, metadata, True) is None
    planner, plan = _planned(state, metadata)
    want = create_default_local_load_plan(planner.state_dict, metadata, True).items
    assert plan.items == want
    assert [i.storage_index.offset for i in want[:2]] == [torch.Size([0, 0]), torch.Size([2, 0])]


@pytest.mark.parametrize("partial", [False, True])
def test_keys_only_one_side_has_are_planned_as_dcp_plans_them(partial):
    metadata = Metadata({"a": _tensor_md([3], [([0], [3])]), "b": BytesStorageMetadata()})
    state = {"a": torch.zeros(3), "b": 1, "extra": torch.zeros(2)}
    if not partial:
        with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: extra"):
            _planned(state, metadata)
        return
    planner, plan = _planned(state, metadata, allow_partial_load=True)
    assert [i.dest_index.fqn for i in plan.items] == ["a", "b"]
    assert plan.items == create_default_local_load_plan(planner.state_dict, metadata,
                                                        False).items


def test_a_size_that_differs_gets_dcps_error_naming_the_tensor():
    metadata = Metadata({"w": _tensor_md([3], [([0], [3])])})
    with pytest.raises(ValueError, match="Size mismatch.*for w"):
        _planned({"w": torch.zeros(4)}, metadata)


def test_a_tensor_subclass_is_left_to_dcp():
    class Tagged(torch.Tensor):
        pass
    metadata = Metadata({"w": _tensor_md([3], [([0], [3])])})
    state = {"w": torch.zeros(3).as_subclass(Tagged)}
    assert whole_reads_module.whole_reads(state, metadata, True) is None
    planner, plan = _planned(state, metadata)
    assert plan.items == create_default_local_load_plan(planner.state_dict, metadata, True).items
