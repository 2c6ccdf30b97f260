"""A record our reader refuses reaches the user as our own error through ``dcp.load``, on
every supported torch: DCP catches what ``read_metadata`` raises (torch 2.11 drops it and
reports ``AssertionError: metadata is None``; later releases keep only its text), so DCP's
rank-local retry gets a stand-in record whose first use raises it (readers/base.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus import LocalReader, SafeLoadPlanner
from dcp_plus._compat.torch_dcp import EmptyStateDictLoadPlanner
from dcp_plus.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    DcpPlusError,
    UnsafeCheckpointError,
)
from tests.conftest import assert_bit_exact, read_record_json, save, write_record_json

STATE = {"w": torch.arange(6.0), "b": torch.ones(3, dtype=torch.bfloat16)}


def _no_record(ckpt: Path) -> None:
    (ckpt / ".metadata").unlink()  # what an interrupted save leaves


def _stock(ckpt: Path) -> None:
    shutil.rmtree(ckpt)
    dcp.save(STATE, storage_writer=FileSystemWriter(ckpt), no_dist=True)


def _unknown_version(ckpt: Path) -> None:
    rec = read_record_json(ckpt)
    rec["version"] = 99
    write_record_json(ckpt, rec)


def _outside(ckpt: Path) -> None:
    rec = read_record_json(ckpt)
    for e in rec["extents"]:
        e["file"] = "../elsewhere"
    write_record_json(ckpt, rec)


CASES: dict[str, tuple[Callable[[Path], None], type[DcpPlusError], str]] = {
    "no commit record": (_no_record, CheckpointNotFoundError, "no commit record"),
    "stock pickle": (_stock, UnsafeCheckpointError, "allow_pickle=True"),
    "unknown version": (_unknown_version, CheckpointFormatError, "'version'"),
    "outside the checkpoint": (_outside, CheckpointFormatError, "escapes the checkpoint"),
}
PLANNERS: dict[str, Callable[[], Any]] = {
    "SafeLoadPlanner": SafeLoadPlanner,
    "DefaultLoadPlanner": DefaultLoadPlanner,
    "empty state dict": EmptyStateDictLoadPlanner,  # what `dcp-plus convert` loads with
}


def _target(planner: str) -> dict[str, Any]:
    return {} if planner == "empty state dict" else {k: torch.zeros_like(v)
                                                     for k, v in STATE.items()}


def _failure(e: CheckpointException) -> BaseException:
    (failure,) = e.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("case", CASES)
def test_a_refused_record_reaches_the_user_as_our_error(tmp_path, case, planner):
    damage, error, needle = CASES[case]
    ckpt = tmp_path / "ckpt"
    save(STATE, ckpt)
    damage(ckpt)

    with pytest.raises(CheckpointException) as info:
        dcp.load(_target(planner), storage_reader=LocalReader(ckpt),
                 planner=PLANNERS[planner](), no_dist=True)

    cause = _failure(info.value)
    assert isinstance(cause, error), repr(cause)
    assert needle in str(cause) and str(ckpt) in str(cause), str(cause)
    assert "metadata is None" not in str(info.value)


def test_a_reader_that_refused_loads_once_the_checkpoint_is_there(tmp_path):
    ckpt = tmp_path / "ckpt"
    reader = LocalReader(ckpt)
    with pytest.raises(CheckpointException, match="no commit record"):
        dcp.load(_target("SafeLoadPlanner"), storage_reader=reader,
                 planner=SafeLoadPlanner(), no_dist=True)

    save(STATE, ckpt)
    out = _target("SafeLoadPlanner")
    dcp.load(out, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)

    assert_bit_exact(out, STATE)


def test_read_metadata_called_directly_raises_and_its_stand_in_raises_too(tmp_path):
    ckpt = tmp_path / "ckpt"
    reader = LocalReader(ckpt)
    with pytest.raises(CheckpointNotFoundError, match="no commit record"):
        reader.read_metadata()
    # what DCP's rank-local retry gets: any use of it raises the refusal
    stand_in = reader.read_metadata(rank=0)
    for field in ("state_dict_metadata", "planner_data", "storage_data", "storage_meta"):
        with pytest.raises(CheckpointNotFoundError, match="no commit record"):
            getattr(stand_in, field)
    with pytest.raises(CheckpointNotFoundError, match="no commit record"):
        reader.read_metadata()  # a call without rank= never gets the stand-in
    save(STATE, ckpt)
    # DCP's retry right after a failure never reads again, even if the record is there now:
    # this rank would plan alone while the others wait in a collective
    assert type(reader.read_metadata(rank=0)).__name__ == "RefusedRecord"

    md = reader.read_metadata()  # the next load's first call reads afresh

    assert set(md.state_dict_metadata) == set(STATE)
