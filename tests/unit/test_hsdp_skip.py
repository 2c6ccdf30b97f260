"""HSDP staging skip in one process: the planner's write-set query, the stager's skip, the
stale-view check that fails a save instead of writing skipped bytes, and the guards around it.

In one process every tensor is written, so a stub planner stands in for "another replica
writes this" where the stager's side is tested; the real planner is always the one checking.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_plus import ArenaStager, CachedSavePlanner
from dcp_plus._compat.torch_dcp import flatten_state_dict
from dcp_plus.errors import StagingError, StaleStagingError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.planners.write_set import tensor_fqns
from dcp_plus.stagers.tree import capture, fqns_of

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"a": torch.randn(1000, generator=g), "b": torch.randn(3000, generator=g)},
        "optim": {"state": {"a": {"step": torch.tensor(3.0), "m": torch.randn(1000, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]},
        "step": 7,
    }


FQNS = ["model.a", "model.b", "optim.state.a.step", "optim.state.a.m"]


def _finish_with(planner: CachedSavePlanner, sd: dict[str, Any], write: set[str]) -> SavePlan:
    """Run the planner's set-up and finish_plan with a final plan writing only ``write``."""
    planner.set_up_planner(sd, is_coordinator=True)
    full = create_default_local_save_plan(planner.state_dict, True)
    items = [i for i in full.items if i.index.fqn in write or i.tensor_data is None]
    return planner.finish_plan(SavePlan(items))


class Stub:
    """Stands in for the planner the stager asks: "these were written by another replica"."""

    def __init__(self) -> None:
        self.skip: frozenset[str] = frozenset()
        self.asked: list[list[str]] = []

    def unwritten_tensor_fqns(self, fqns: Sequence[str]) -> frozenset[str]:
        self.asked.append(list(fqns))
        return self.skip


def _save(stager: ArenaStager, sd: dict[str, Any], path: Path, planner: Any) -> Any:
    resp = dcp.async_save(sd, checkpoint_id=str(path), planner=planner, async_stager=stager,
                          no_dist=True)
    resp.staging_completion.result()
    return resp


def _failure(resp: Any) -> str:
    """The text of the save's failure (the exception itself is not kept: its frames hold the
    staged dict)."""
    with pytest.raises(CheckpointException) as info:
        resp.upload_completion.result()
    return str(info.value)


def _load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    target = {"model": {k: torch.zeros_like(v) for k, v in like["model"].items()}}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target["model"]


# -- fqns: the stager's names are DCP's flattened keys -------------------------------------


def test_stager_fqns_equal_dcp_flattened_tensor_keys_for_nested_dicts_and_lists() -> None:
    sd = _sd()
    sd["extra"] = {"list": [torch.ones(2), 3, {"deep": torch.zeros(1)}], "n": None, 5: torch.ones(1)}
    flat, _ = flatten_state_dict(sd)
    assert fqns_of(capture(sd).skeleton) == list(tensor_fqns(flat))


def test_a_tensor_dcp_does_not_flatten_is_never_skipped() -> None:
    # DCP treats a tuple as one leaf (pickled as bytes): the names differ, so the query of a
    # real planner returns nothing and every tensor is copied.
    sd = {"t": (torch.ones(2), torch.zeros(2)), "w": torch.ones(3)}
    planner = CachedSavePlanner()
    planner.unwritten_tensor_fqns([])  # start recording
    _finish_with(planner, sd, set())
    stager_fqns = fqns_of(capture(sd).skeleton)
    assert stager_fqns == ["t.0", "t.1", "w"]
    assert planner.unwritten_tensor_fqns(stager_fqns) == frozenset()


# -- the planner's query --------------------------------------------------------------------


def test_query_returns_what_the_last_final_plan_did_not_write_for_the_same_structure() -> None:
    planner = CachedSavePlanner()
    assert planner.unwritten_tensor_fqns(FQNS) == frozenset()  # nothing recorded yet
    _finish_with(planner, _sd(), {"model.a", "optim.state.a.m"})
    assert planner.unwritten_tensor_fqns(FQNS) == {"model.b", "optim.state.a.step"}
    assert planner.unwritten_tensor_fqns(FQNS[:3]) == frozenset()  # another structure
    assert planner.unwritten_tensor_fqns(list(reversed(FQNS))) == frozenset()  # another order
    _finish_with(planner, _sd(), set(FQNS))
    assert planner.unwritten_tensor_fqns(FQNS) == frozenset()


def test_planners_nobody_asked_record_nothing() -> None:
    planner = CachedSavePlanner()
    _finish_with(planner, _sd(), {"model.a"})
    assert planner.unwritten_tensor_fqns(FQNS) == frozenset()  # recording starts now
    _finish_with(planner, _sd(), {"model.a"})
    assert planner.unwritten_tensor_fqns(FQNS) == {"model.b", "optim.state.a.step",
                                                    "optim.state.a.m"}


def test_query_after_real_saves_hit_and_miss(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    planner.unwritten_tensor_fqns(FQNS)
    for i in range(2):
        dcp.save(sd, checkpoint_id=str(tmp_path / str(i)), planner=planner, no_dist=True)
    assert planner.last_was_hit
    assert planner.unwritten_tensor_fqns(FQNS) == frozenset()  # one rank writes everything


# -- the stager's skip and the planner's check ----------------------------------------------


def test_skipped_tensors_are_not_copied_and_counted(tmp_path: Path) -> None:
    sd, stub = _sd(), Stub()
    with ArenaStager(skip_unwritten=stub) as stager:
        stub.skip = frozenset({"model.b"})
        staged = stager.stage(sd).result()
        # first snapshot of a structure: nothing to compare with, everything copied
        assert stager.last_skipped_bytes == 0
        assert stager.last_copied_bytes == 4 * (1000 + 3000 + 1 + 1000)
        del staged
        assert stager.wait_persisted(5)
        sd["model"]["a"].add_(1)
        sd["model"]["b"].add_(1)
        staged = stager.stage(sd).result()
        assert stager.last_skipped_bytes == 4 * 3000
        assert stager.last_copied_bytes == 4 * (1000 + 1 + 1000)
        assert torch.equal(staged["model"]["a"], sd["model"]["a"])
        assert not torch.equal(staged["model"]["b"], sd["model"]["b"])  # stale, as intended
        entry = stale_views.get(staged.owner)
        assert entry is not None and set(entry.views.values()) == {"model.b"}
        assert stub.asked[-1] == FQNS
        owner = staged.owner
        del staged
        assert stager.wait_persisted(5)
        assert stale_views.get(owner) is None  # released with its snapshot


def test_a_save_that_must_write_a_skipped_tensor_fails_and_the_next_one_is_correct(
    tmp_path: Path,
) -> None:
    sd, stub, planner = _sd(), Stub(), CachedSavePlanner()
    with ArenaStager(skip_unwritten=stub) as stager:
        _save(stager, sd, tmp_path / "0", planner).upload_completion.result()
        sd["model"]["b"].add_(1)
        stub.skip = frozenset({"model.b"})  # "another replica writes model.b": it does not
        resp = _save(stager, sd, tmp_path / "1", planner)
        assert stager.last_skipped_bytes == 4 * 3000
        error = _failure(resp)
        assert "StaleStagingError" in error and "model.b" in error
        assert not (tmp_path / "1" / ".metadata").exists()
        del resp  # the future's exception (its traceback's frames) holds the staged dict
        assert stager.wait_persisted(5)
        sd["model"]["b"].add_(1)
        _save(stager, sd, tmp_path / "2", planner).upload_completion.result()
        assert stager.last_skipped_bytes == 0  # the failure paused skipping for one snapshot
        assert stager.skip_off is None
        loaded = _load(tmp_path / "2", sd)
        assert all(torch.equal(loaded[k], v) for k, v in sd["model"].items())


def test_the_check_reports_every_stale_tensor_by_name() -> None:
    sd, stub, planner = _sd(), Stub(), CachedSavePlanner()
    with ArenaStager(skip_unwritten=stub) as stager:
        stager.stage(sd).result()
        assert stager.wait_persisted(5)
        stub.skip = frozenset({"model.b", "optim.state.a.m"})
        staged = stager.stage(sd).result()
        with pytest.raises(StaleStagingError, match=r"2 tensor\(s\).*model\.b, optim\.state\.a\.m"):
            _finish_with(planner, staged, {"model.a", "model.b", "optim.state.a.m"})
        planner.unwritten_tensor_fqns(FQNS)
        _finish_with(planner, staged, {"model.a", "optim.state.a.step"})  # writes no stale one
        entry = stale_views.get(staged.owner)
        assert entry is not None and entry.checked and entry.failed == ["model.b",
                                                                        "optim.state.a.m"]
        del staged


def test_a_save_without_the_check_turns_skipping_off_for_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd, stub = _sd(), Stub()
    with ArenaStager(skip_unwritten=stub) as stager:
        _save(stager, sd, tmp_path / "0", DefaultSavePlanner()).upload_completion.result()
        stub.skip = frozenset({"model.b"})
        with caplog.at_level(logging.ERROR, logger="dcp_plus.stagers.arena_stager"):
            resp = _save(stager, sd, tmp_path / "1", DefaultSavePlanner())
            resp.upload_completion.result()  # a stock planner has no check
            del resp
            assert stager.wait_persisted(5)
        assert stager.skip_off is not None and "another planner" in stager.skip_off
        assert "skipping is off" in caplog.text
        _save(stager, sd, tmp_path / "2", DefaultSavePlanner()).upload_completion.result()
        assert stager.last_skipped_bytes == 0
        stager.skip_unwritten_by(stub)  # re-armed explicitly
        assert stager.skip_off is None


def test_process_executor_is_detected_and_never_skipped() -> None:
    # the executor kind a caller of DCP's async_save passes on to the stager
    ns: dict[str, Any] = {}
    exec(
        "def async_save(stager, sd, async_checkpointer_type):\n"
        "    stager.executor = async_checkpointer_type.name.lower()\n"
        "    return stager.stage(sd)\n",
        ns,
    )
    sd, stub = _sd(), Stub()
    stub.skip = frozenset({"model.b"})
    with ArenaStager(skip_unwritten=stub) as stager:
        for _ in range(2):
            ns["async_save"](stager, sd, AsyncCheckpointerType.PROCESS).result()
            assert stager.wait_persisted(5)
        assert stager.last_skipped_bytes == 0 and not stub.asked
        staged = ns["async_save"](stager, sd, AsyncCheckpointerType.THREAD).result()
        assert stager.last_skipped_bytes == 4 * 3000
        # last resort: a staged dict with stale views refuses to be pickled
        with pytest.raises(StagingError, match="THREAD executor only"):
            pickle.dumps(staged)
        del staged


def test_skip_needs_a_planner_with_the_query() -> None:
    with pytest.raises(TypeError, match="CachedSavePlanner"):
        ArenaStager(skip_unwritten=DefaultSavePlanner())  # type: ignore[arg-type]


def test_structure_change_on_this_rank_copies_everything() -> None:
    sd, stub = _sd(), Stub()
    stub.skip = frozenset({"model.b"})
    with ArenaStager(skip_unwritten=stub) as stager:
        stager.stage(sd).result()
        assert stager.wait_persisted(5)
        sd["model"]["c"] = torch.ones(10)
        stager.stage(sd).result()
        assert stager.last_skipped_bytes == 0  # new arena: not the previous snapshot's shape
        assert stager.wait_persisted(5)
        stager.stage(sd).result()
        assert stager.last_skipped_bytes == 4 * 3000


def test_a_pickled_staged_dict_turns_skipping_off_by_default() -> None:
    sd, stub = _sd(), Stub()
    stub.skip = frozenset({"model.b"})
    with ArenaStager(skip_unwritten=stub) as stager:
        staged = stager.stage(sd).result()
        pickle.dumps(staged)  # no stale views yet: it pickles (DCP's PROCESS executor would)
        del staged
        assert stager.wait_persisted(5)
        asked = len(stub.asked)
        stager.stage(sd).result()
        assert stager.last_skipped_bytes == 0 and len(stub.asked) == asked


def test_executor_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="'thread', 'process', 'other'"):
        ArenaStager(executor="threads")  # type: ignore[arg-type]
