"""Saving where a committed checkpoint already is: refused, or replaced only on commit."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus import LocalWriter
from dcp_plus.errors import CheckpointExistsError
from tests.conftest import (
    assert_bit_exact,
    build_state_dict,
    clone_state,
    data_files,
    load,
    load_target,
    record_path,
    referenced_files,
    save,
    slab_state_dict,
)


def _listing(path: os.PathLike) -> dict[str, bytes]:
    return {p: open(os.path.join(path, p), "rb").read() for p in os.listdir(path)}


def test_save_into_a_committed_checkpoint_is_refused(tmp_path):
    v1 = build_state_dict(seed=1)
    save(v1, tmp_path / "ckpt")
    before = _listing(tmp_path / "ckpt")

    with pytest.raises(CheckpointException) as info:
        save(build_state_dict(seed=2), tmp_path / "ckpt")

    assert "CheckpointExistsError" in str(info.value) and "overwrite=True" in str(info.value)
    assert _listing(tmp_path / "ckpt") == before
    assert_bit_exact(load(load_target(v1), tmp_path / "ckpt"), v1)
    with pytest.raises(CheckpointExistsError, match=str(tmp_path / "ckpt")):
        LocalWriter(tmp_path / "ckpt").set_up_storage_writer(True)


def test_overwrite_commits_the_new_checkpoint_and_then_removes_old_data_files(tmp_path, slab):
    sd, _ = slab_state_dict(slab)
    v1 = {**build_state_dict(seed=1), **sd}
    save(v1, tmp_path / "ckpt")
    old_files = data_files(tmp_path / "ckpt")
    v2 = build_state_dict(seed=2)
    expected = clone_state(v2)

    save(v2, tmp_path / "ckpt", overwrite=True)

    assert_bit_exact(load(load_target(expected), tmp_path / "ckpt"), expected)
    assert not old_files & data_files(tmp_path / "ckpt")
    assert data_files(tmp_path / "ckpt") == referenced_files(tmp_path / "ckpt")


def test_failed_overwrite_leaves_the_old_checkpoint_loadable(tmp_path):
    v1 = build_state_dict(seed=1)
    save(v1, tmp_path / "ckpt")
    record = record_path(tmp_path / "ckpt").read_bytes()
    v2 = {**build_state_dict(seed=2), "bad": object()}  # refused while writing

    with pytest.raises(CheckpointException, match="UnsafeValueError"):
        save(v2, tmp_path / "ckpt", overwrite=True)

    assert record_path(tmp_path / "ckpt").read_bytes() == record
    assert_bit_exact(load(load_target(v1), tmp_path / "ckpt"), v1)


def test_files_of_another_save_neither_block_nor_are_removed_by_an_overwrite(tmp_path):
    # a file of another save (one that crashed, or one still running in another process)
    # is not the replaced record's: the overwrite removes only what that record referenced
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "__0_0.deadbeefdeadbeef.dcpp").write_bytes(b"partial")
    v1 = {"w": torch.arange(10.0)}

    save(v1, ckpt)  # no commit record there: not an existing checkpoint
    assert_bit_exact(load(load_target(v1), ckpt), v1)
    first = referenced_files(ckpt)
    save({"w": torch.ones(10)}, ckpt, overwrite=True)

    assert (ckpt / "__0_0.deadbeefdeadbeef.dcpp").read_bytes() == b"partial"
    assert not first & data_files(ckpt)
    assert data_files(ckpt) == referenced_files(ckpt) | {"__0_0.deadbeefdeadbeef.dcpp"}


def test_dcp_plan_caching_overwriting_one_directory_saves_every_time(tmp_path):
    # DCP's cache skips prepare_global_plan on a hit: each save's id must not come from it
    planner = type("CachedForOverwrite", (DefaultSavePlanner,), {})(enable_plan_caching=True)
    for i in range(4):
        sd = {"w": torch.full((1000,), float(i)), "b": torch.arange(10) * i}
        dcp.save(sd, storage_writer=LocalWriter(tmp_path / "ckpt", overwrite=True),
                 planner=planner, no_dist=True)
        assert_bit_exact(load(load_target(sd), tmp_path / "ckpt"), sd)
        assert data_files(tmp_path / "ckpt") == referenced_files(tmp_path / "ckpt")


def test_a_record_committed_meanwhile_is_never_replaced_without_overwrite(tmp_path):
    ckpt = tmp_path / "ckpt"

    class Racing(LocalWriter):
        def write_data(self, plan, planner):  # another job commits while this one writes
            record_path(ckpt).write_bytes(b"the other job's record")
            return super().write_data(plan, planner)

    with pytest.raises(CheckpointException, match="CheckpointExistsError"):
        dcp.save({"w": torch.ones(4)}, storage_writer=Racing(ckpt), no_dist=True)
    assert record_path(ckpt).read_bytes() == b"the other job's record"


@pytest.mark.parametrize("in_slabs", [False, True], ids=["bounce", "slab-workers"])
def test_a_refused_commit_leaves_only_the_winners_files(tmp_path, slab, in_slabs):
    """Two saves into one new folder: the one that commits second is refused, and takes its
    data files and extent tables with it."""
    ckpt = tmp_path / "ckpt"
    winner = build_state_dict(seed=1)
    loser = slab_state_dict(slab)[0] if in_slabs else build_state_dict(seed=2)

    class Racing(LocalWriter):
        def finish(self, metadata, results):  # the other save commits as this one is done
            save(winner, ckpt)
            return super().finish(metadata, results)

    with pytest.raises(CheckpointException, match="CheckpointExistsError"):
        dcp.save(loser, storage_writer=Racing(ckpt, workers=1), no_dist=True)
    assert data_files(ckpt) == referenced_files(ckpt)
    assert sorted(os.listdir(ckpt)) == sorted(data_files(ckpt) | {".metadata"})
    assert_bit_exact(load(load_target(winner), ckpt), winner)


def test_a_commit_refused_although_its_record_landed_keeps_its_files(tmp_path):
    """A store that cannot tell whether a retried commit took effect (a lost reply on NFS)
    may refuse a record it did write: the save's files must stay, its checkpoint loads. The
    lost reply cannot be produced on a local disk, so the put says "refused" after writing."""
    ckpt = tmp_path / "ckpt"
    sd = build_state_dict(seed=3)

    class LostReply(LocalWriter):
        def finish(self, metadata, results):
            store = self._store
            put = store.put

            def put_then_refuse(name, data, *, if_absent):
                put(name, data, if_absent=if_absent)
                return False
            store.put = put_then_refuse
            try:
                return super().finish(metadata, results)
            finally:
                del store.put

    with pytest.raises(CheckpointException, match="CheckpointExistsError"):
        dcp.save(sd, storage_writer=LostReply(ckpt), no_dist=True)
    assert data_files(ckpt) and data_files(ckpt) == referenced_files(ckpt)
    assert_bit_exact(load(load_target(sd), ckpt), sd)
