"""Non-tensor values as stock DCP users keep them: ``io.BytesIO`` stored raw and loaded back
without pickle, values that need pickle refused unless the writer and reader both allow it."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from dcp_plus import ArenaStager, LocalReader, LocalWriter, SafeLoadPlanner
from tests.conftest import load, read_record_json, save


class TrainState(Stateful):
    """A train state that keeps its loss history as torch.save bytes in a BytesIO."""

    def __init__(self, step: int = 0, losses: list[float] | None = None) -> None:
        self.step, self.losses = step, losses or []

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step), "losses": buf}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        sd["losses"].seek(0)
        self.losses = torch.load(sd["losses"], weights_only=True)


class Opaque:
    """A value only full unpickling can rebuild."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def test_a_bytesio_value_is_stored_raw_and_loads_back_as_a_bytesio(tmp_path):
    payload = b"\x80\x02 not a pickle at all \x00\xff" * 10
    save({"w": torch.ones(3), "blob": io.BytesIO(payload)}, tmp_path / "ckpt")
    (row,) = [e for e in read_record_json(tmp_path / "ckpt")["extents"] if e["fqn"] == "blob"]
    assert row["value"] == "bytesio" and row["raw_length"] == len(payload)
    with open(tmp_path / "ckpt" / row["file"], "rb") as f:  # raw: the bytes themselves
        f.seek(row["offset"])
        assert f.read(row["length"]) == payload

    for planner in (SafeLoadPlanner(), DefaultLoadPlanner()):
        out = load({"w": torch.zeros(3), "blob": io.BytesIO()}, tmp_path / "ckpt", planner)
        assert isinstance(out["blob"], io.BytesIO) and out["blob"].getvalue() == payload


def test_a_stateful_keeping_a_bytesio_round_trips_through_async_save(tmp_path):
    with ArenaStager() as stager:
        dcp.async_save({"train": TrainState(5, [3.0, 2.5, 2.25])},
                       storage_writer=LocalWriter(tmp_path / "ckpt"), async_stager=stager,
                       no_dist=True).upload_completion.result()
    back = TrainState()
    dcp.load({"train": back}, storage_reader=LocalReader(tmp_path / "ckpt"),
             planner=SafeLoadPlanner(), no_dist=True)
    assert back.step == 5 and back.losses == [3.0, 2.5, 2.25]


def test_a_stock_dcp_bytesio_loads_with_the_safe_planner(tmp_path):
    dcp.save({"blob": io.BytesIO(b"abc")}, storage_writer=FileSystemWriter(tmp_path / "s"),
             no_dist=True)
    out = load({"blob": io.BytesIO()}, tmp_path / "s", allow_pickle=True)
    assert out["blob"].getvalue() == b"abc"


def test_a_value_needing_pickle_is_refused_unless_writer_and_reader_allow_it(tmp_path):
    with pytest.raises(CheckpointException, match=r"'obj'.*allow_pickle=True"):
        save({"obj": Opaque(3)}, tmp_path / "refused")

    save({"obj": Opaque(3)}, tmp_path / "ckpt", allow_pickle=True)
    with pytest.raises(CheckpointException, match="'obj'"):
        load({"obj": None}, tmp_path / "ckpt")  # SafeLoadPlanner never unpickles it
    with pytest.raises(CheckpointException, match="UnsafeValueError"):
        load({"obj": None}, tmp_path / "ckpt", DefaultLoadPlanner())  # nor the reader
    out = load({"obj": None}, tmp_path / "ckpt", DefaultLoadPlanner(), allow_pickle=True)
    assert out["obj"] == Opaque(3)


def test_empty_values_load_wherever_they_were_placed(tmp_path):
    # an empty BytesIO gets an aligned offset that may lie past its file's end
    sd = {"w": torch.ones(3), "blob": io.BytesIO(b"x" * 5000), "empty": io.BytesIO(b""),
          "also": io.BytesIO(b""), "step": 3}
    save(sd, tmp_path / "ckpt")
    out = load({"w": torch.zeros(3), "blob": io.BytesIO(), "empty": io.BytesIO(b"junk"),
                "also": io.BytesIO(b"junk"), "step": 0}, tmp_path / "ckpt")
    assert out["blob"].getvalue() == b"x" * 5000 and out["step"] == 3
    assert out["empty"].getvalue() == b"" and out["also"].getvalue() == b""


def test_a_value_allowed_only_inside_a_safe_globals_block_is_refused_after_it(tmp_path):
    # the save-time check remembers safe values: the memory must not outlive the allow-list
    # that made a value safe, nor let the second save of an unsafe value through
    for i in range(2):
        with pytest.raises(CheckpointException, match="'obj'"):
            save({"obj": Opaque(5)}, tmp_path / f"before{i}")
    with torch.serialization.safe_globals([Opaque]):
        for i in range(2):
            save({"obj": Opaque(5)}, tmp_path / f"inside{i}")
    with pytest.raises(CheckpointException, match="'obj'"):
        save({"obj": Opaque(5)}, tmp_path / "after")
