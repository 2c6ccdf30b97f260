"""Invariant 5: loading executes no code and never reads outside the checkpoint directory;
saving refuses values that would not load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus import LocalReader, SafeLoadPlanner
from dcp_plus.errors import CheckpointFormatError, UnsafeCheckpointError
from tests.conftest import (
    assert_bit_exact,
    build_state_dict,
    clone_state,
    data_files,
    extent_checksum,
    load,
    load_fails,
    load_target,
    read_record_json,
    record_path,
    save,
    write_record_json,
)


class Custom:
    """An ordinary user class: pickles by reference, so weights_only loading refuses it."""

    def __init__(self) -> None:
        self.x = 1


class Payload:
    """Unpickling this creates ``marker``: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _stock_save(sd: dict[str, Any], path: os.PathLike) -> None:
    dcp.save(sd, storage_writer=FileSystemWriter(path), no_dist=True)


# ---------------------------------------------------------------------------------------------
# Stock (pickled) commit records


def test_stock_checkpoint_is_refused_without_allow_pickle(tmp_path):
    sd = {"w": torch.arange(4.0)}
    _stock_save(sd, tmp_path / "stock")

    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        LocalReader(tmp_path / "stock").read_metadata()
    msg = load_fails(load_target(sd), tmp_path / "stock")
    assert "allow_pickle=True" in msg and "pickle" in msg


def test_stock_checkpoint_loads_with_allow_pickle(tmp_path):
    sd = build_state_dict(seed=6)
    expected = clone_state(sd)
    _stock_save(sd, tmp_path / "stock")

    loaded = load(load_target(expected), tmp_path / "stock", allow_pickle=True)

    assert_bit_exact(loaded, expected)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickled_record_that_runs_code_is_refused_and_nothing_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    record_path(ckpt).write_bytes(pickle.dumps(Payload(str(marker)), protocol=protocol))

    with pytest.raises((UnsafeCheckpointError, CheckpointFormatError)):
        LocalReader(ckpt).read_metadata()
    load_fails({"w": torch.zeros(2)}, ckpt)

    assert not marker.exists()


def test_safe_load_planner_refuses_unsafe_value_in_stock_checkpoint(tmp_path):
    _stock_save({"w": torch.ones(3), "extra": {"obj": Custom()}}, tmp_path / "stock")

    msg = load_fails({"w": torch.zeros(3), "extra": {"obj": None}}, tmp_path / "stock",
                     allow_pickle=True)

    assert "UnsafeCheckpointError" in msg and "'extra.obj'" in msg, msg
    assert "tests.unit.test_safety.Custom" in msg, msg


@pytest.mark.parametrize("reader", ["local", "stock"])
def test_safe_load_planner_runs_no_code_from_a_stock_checkpoint(tmp_path, reader):
    marker = tmp_path / "pwned"
    _stock_save({"w": torch.ones(3), "evil": Payload(str(marker))}, tmp_path / "stock")
    assert not marker.exists()
    storage_reader = (LocalReader(tmp_path / "stock", allow_pickle=True) if reader == "local"
                      else FileSystemReader(tmp_path / "stock"))

    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(3), "evil": None}, storage_reader=storage_reader,
                  planner=SafeLoadPlanner(), no_dist=True)

    assert "'evil'" in str(info.value)
    assert not marker.exists()


def test_reader_refuses_unpickling_a_crafted_value_even_with_the_default_planner(tmp_path):
    # a dcp_plus checkpoint whose non-tensor value was replaced by a payload, with a
    # matching checksum: only the reader's own weights_only check stands in the way
    marker = tmp_path / "pwned"
    save({"w": torch.ones(3), "v": 1}, tmp_path / "ckpt")
    buf = io.BytesIO()
    torch.save(Payload(str(marker)), buf)
    evil = buf.getvalue()
    (tmp_path / "ckpt" / "__0_9.0bad.dcpp").write_bytes(evil)
    rec = read_record_json(tmp_path / "ckpt")
    ext = next(e for e in rec["extents"] if e["fqn"] == "v")
    ext.update(file="__0_9.0bad.dcpp", offset=0, length=len(evil), raw_length=len(evil))
    ext["checksum"] = extent_checksum(rec, ext, evil)
    write_record_json(tmp_path / "ckpt", rec)

    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(3), "v": 0},
                 storage_reader=LocalReader(tmp_path / "ckpt"), no_dist=True)

    assert "UnsafeValueError" in str(info.value) and "'v'" in str(info.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Saving values that would not load safely


@pytest.mark.parametrize("where", ["top", "nested_dict", "in_list"])
def test_save_refuses_value_that_needs_unpickling_naming_its_key(tmp_path, where):
    sd: dict[str, Any] = {"w": torch.ones(2), "cfg": {"lr": 0.1, "items": [1, 2]}}
    key = {"top": "obj", "nested_dict": "cfg.obj", "in_list": "cfg.items.1"}[where]
    if where == "top":
        sd["obj"] = Custom()
    elif where == "nested_dict":
        sd["cfg"]["obj"] = Custom()
    else:
        sd["cfg"]["items"] = [torch.ones(1), Custom()]  # with a tensor, DCP flattens lists

    with pytest.raises(CheckpointException) as info:
        save(sd, tmp_path / "ckpt")

    msg = str(info.value)
    assert "UnsafeValueError" in msg and repr(key) in msg
    # names what was refused, without torch's advice to retry with weights_only=False
    assert "tests.unit.test_safety.Custom" in msg and "\x1b[" not in msg, msg
    assert not record_path(tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------------
# Paths that leave the checkpoint directory


@pytest.fixture
def saved(tmp_path):
    sd = {"w": torch.arange(64, dtype=torch.int32), "b": torch.ones(5), "n": 3}
    save(sd, tmp_path / "ckpt")
    return tmp_path / "ckpt", sd


def _point_extents(ckpt: os.PathLike, name: str) -> None:
    rec = read_record_json(ckpt)
    for e in rec["extents"]:
        e["file"] = name
    write_record_json(ckpt, rec)


@pytest.mark.parametrize("kind", ["parent", "absolute"])
def test_record_naming_a_file_outside_the_checkpoint_is_refused(saved, kind):
    ckpt, sd = saved
    name = sorted(data_files(ckpt))[0]
    # an identical copy outside: reading it would even pass the checksums
    shutil.copy(ckpt / name, ckpt.parent / "x")
    _point_extents(ckpt, "../x" if kind == "parent" else str(ckpt.parent / "x"))

    msg = load_fails(load_target(sd), ckpt)

    assert "escapes the checkpoint directory" in msg and ".file" in msg, msg


def test_data_file_symlinked_outside_is_refused(saved):
    ckpt, sd = saved
    outside = ckpt.parent / "outside"
    outside.mkdir()
    for name in data_files(ckpt):
        shutil.move(ckpt / name, outside / name)
        os.symlink(outside / name, ckpt / name)

    msg = load_fails(load_target(sd), ckpt)

    assert "outside the checkpoint directory" in msg, msg


def test_subdirectory_symlinked_outside_is_refused(saved):
    ckpt, sd = saved
    outside = ckpt.parent / "outside"
    outside.mkdir()
    name = sorted(data_files(ckpt))[0]
    shutil.copy(ckpt / name, outside / name)
    os.symlink(outside, ckpt / "sub")
    rec = read_record_json(ckpt)
    for e in rec["extents"]:
        if e["file"] == name:
            e["file"] = f"sub/{name}"
    write_record_json(ckpt, rec)

    msg = load_fails(load_target(sd), ckpt)

    assert "outside the checkpoint directory" in msg, msg


def test_checkpoint_reached_through_a_symlinked_directory_loads(saved):
    ckpt, sd = saved
    os.symlink(ckpt, ckpt.parent / "latest")

    assert_bit_exact(load(load_target(sd), ckpt.parent / "latest"), sd)
