"""Incremental checkpoints through the stock entry points: ``dcp.save`` with
``LocalWriter(base=...)``, ``dcp.load`` with ``LocalReader``. Chains load bit-exact, unchanged
parts are not written again, deltas decode, and a damaged or missing base is named."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus import ArenaStager, LocalReader, LocalWriter
from dcp_plus.errors import CheckpointFormatError, CheckpointNotFoundError, InvalidOptionError
from dcp_plus.format.parts import DELTA_CODEC
from tests.conftest import (
    assert_bit_exact,
    clone_state,
    flip_byte,
    load,
    load_fails,
    load_target,
    random_tensor,
    read_record_json,
)

MIB = 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {f"t.{str(d).removeprefix('torch.')}": random_tensor((300, 1111), d, gen)
                          for d in DTYPES}
    sd["frozen"] = random_tensor((3 * MIB // 4,), torch.float32, gen)  # 3 parts, never changed
    sd["emb"] = random_tensor((4096, 256), torch.float32, gen)  # 4 parts
    sd["small"] = random_tensor((7,), torch.bfloat16, gen)
    sd["empty"] = torch.zeros(0, 3)
    sd["meta"] = {"step": 0, "lr": [0.1, 0.01]}
    return sd


def _train_step(sd: dict[str, Any], step: int) -> None:
    """Change part of the state: one row of the embedding table (in its part ``step % 4``,
    so that later links reference each earlier one), a slice of two tensors."""
    gen = torch.Generator().manual_seed(1000 + step)
    sd["emb"][step % 4 * 1024 + 5] += 1.0
    sd["t.bfloat16"][step] = random_tensor((1111,), torch.bfloat16, gen)
    sd["t.int64"].view(-1)[: 1000 * step] += 1
    sd["small"].add_(1)
    sd["meta"]["step"] = step


def _save(sd: dict[str, Any], path: Path, **kw: Any) -> None:
    dcp.save(sd, storage_writer=LocalWriter(path, **kw), no_dist=True)


def _new_bytes(path: Path) -> int:
    """Blocks the checkpoint's own files take on disk (the record included)."""
    return sum(f.stat().st_blocks * 512 for f in path.iterdir())


def test_a_chain_of_five_links_loads_bit_exact_and_writes_only_what_changed(tmp_path):
    sd = _state()
    expected = []
    _save(sd, tmp_path / "s0", incremental=True)
    expected.append(clone_state(sd))
    for step in range(1, 5):
        _train_step(sd, step)
        _save(sd, tmp_path / f"s{step}", base=tmp_path / f"s{step - 1}")
        expected.append(clone_state(sd))

    for step, want in enumerate(expected):
        assert_bit_exact(load(load_target(want), tmp_path / f"s{step}"), want)
    full = _new_bytes(tmp_path / "s0")
    for step in range(1, 5):
        # changed: one part of emb, of t.bfloat16 and t.int64 (1,000 * step int64 < 1 MiB),
        # plus small: 4 parts of at most 1 MiB, and the record
        assert _new_bytes(tmp_path / f"s{step}") < 4 * MIB + 64 * 1024, step
    assert full > 12 * MIB
    rec = read_record_json(tmp_path / "s4")
    assert rec["version"] == 5 and rec["bases"] == ["s0", "s1", "s2", "s3"]
    frozen = next(e for e in rec["extents"] if e["fqn"] == "frozen")
    assert frozen["base"] == "s0"  # untouched since the first save: a whole reference


def test_a_deleted_base_is_refused_naming_the_base_and_the_tensor(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "s0", incremental=True)
    _train_step(sd, 1)
    _save(sd, tmp_path / "s1", base=tmp_path / "s0")
    shutil.rmtree(tmp_path / "s0")

    msg = load_fails(load_target(sd), tmp_path / "s1")

    assert "base checkpoint 's0'" in msg and str(tmp_path / "s0") in msg
    assert "'frozen'" in msg or "tensor" in msg


def test_a_flipped_byte_in_a_base_is_detected_when_the_child_loads(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "s0", incremental=True)
    _train_step(sd, 1)
    _save(sd, tmp_path / "s1", base=tmp_path / "s0")
    rec = read_record_json(tmp_path / "s1")
    frozen = next(e for e in rec["extents"] if e["fqn"] == "frozen")
    part = frozen["parts"][1]
    flip_byte(tmp_path / "s0" / part["file"], part["offset"] + 5)

    msg = load_fails(load_target(sd), tmp_path / "s1")

    assert "checksum mismatch" in msg and "'frozen'" in msg and "s0" in msg


def test_a_base_outside_the_checkpoint_s_directory_is_refused(tmp_path):
    with pytest.raises(InvalidOptionError, match="same directory"):
        LocalWriter(tmp_path / "a" / "s1", base=tmp_path / "b" / "s0")


def test_an_uncommitted_base_fails_the_save_and_leaves_nothing_committed(tmp_path):
    sd = _state()
    with pytest.raises(CheckpointException) as info:
        _save(sd, tmp_path / "s1", base=tmp_path / "s0")
    ((error, _),) = info.value.failures.values()  # DCP keeps (exception, traceback)
    assert isinstance(error, CheckpointNotFoundError)
    assert f"{tmp_path / 's0'}: the base" in str(error)
    assert not (tmp_path / "s1" / ".metadata").exists()


def test_a_hostile_reference_leaving_the_parent_directory_is_refused(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "s0", incremental=True)
    _train_step(sd, 1)
    _save(sd, tmp_path / "s1", base=tmp_path / "s0")
    rec = read_record_json(tmp_path / "s1")
    rec["bases"] = ["s0", ".."]
    next(e for e in rec["extents"] if e["fqn"] == "frozen")["base"] = ".."
    from tests.conftest import write_record_json
    write_record_json(tmp_path / "s1", rec)

    with pytest.raises(CheckpointFormatError, match="sibling"):
        LocalReader(tmp_path / "s1").read_metadata()


@pytest.mark.parametrize("workers", [2, 0], ids=["worker-processes", "in-process"])
def test_parts_of_a_stager_snapshot_are_stored_as_deltas_against_the_previous_one(tmp_path,
                                                                                 workers):
    """Sparse updates dirty every part; with the previous snapshot still in its buffer
    (``buffers=2``) the changed parts are XOR deltas, a fraction of their size: encoded by
    the worker processes, or by the saving process (writers without a pool, as NFSWriter)."""
    gen = torch.Generator().manual_seed(3)
    live = {"emb": random_tensor((8192, 256), torch.float32, gen)}  # 8 MiB, 8 parts
    with ArenaStager(buffers=2) as stager:
        staged = stager.stage(live).result()
        first = LocalWriter(tmp_path / "s0", incremental=True)
        first.workers = workers
        dcp.save(staged, storage_writer=first, no_dist=True)
        del staged
        rows = torch.randperm(8192, generator=gen)[:80]  # 1 % of the rows, spread out
        live["emb"][rows] += 0.5
        expected = clone_state(live)
        staged = stager.stage(live).result()
        second = LocalWriter(tmp_path / "s1", base=tmp_path / "s0")
        second.workers = workers
        second.increments = dataclasses.replace(second.increments, old=first.last_slabs)
        dcp.save(staged, storage_writer=second, no_dist=True)
        del staged

    rec = read_record_json(tmp_path / "s1")
    parts = rec["extents"][0]["parts"]
    assert {p["codec"] for p in parts} == {DELTA_CODEC}
    assert sum(p["length"] for p in parts) < 8 * MIB // 10
    assert_bit_exact(load(load_target(expected), tmp_path / "s1"), expected)


def test_a_record_of_parts_is_sealed_json_that_names_its_bases(tmp_path):
    sd = _state()
    _save(sd, tmp_path / "s0", incremental=True)
    rec = json.loads((tmp_path / "s0" / ".metadata").read_bytes())
    assert rec["version"] == 5 and rec["bases"] == [] and rec["layout"] == "rows"
    assert all(e.get("codec") in ("chunked", "identity") for e in rec["extents"])


def test_references_never_leave_a_bucket_or_an_export():
    from dcp_plus.storage.location import normalize_location, sibling_name, sibling_path

    assert sibling_path("s3://bucket/run/s1", "s0") == "s3://bucket/run/s0"
    assert sibling_path("nfs://h:2049/export/t/s1?version=4.1", "s0") == \
        "nfs://h:2049/export/t/s0?version=4.1"
    for root in ("s3://bucket-a", "nfs://h/export"):
        with pytest.raises(InvalidOptionError, match="same bucket or export"):
            sibling_path(root, "elsewhere")
    with pytest.raises(InvalidOptionError, match="same bucket or export"):
        sibling_name("s3://bucket-a", "s3://bucket-b")
    assert normalize_location("nfs://h/e/s2/?version=4.1") == "nfs://h/e/s2?version=4.1"


def test_a_reader_reused_for_another_checkpoint_resolves_its_references_there(tmp_path):
    runs = {}
    for run, seed in (("a", 1), ("b", 2)):
        sd = _state(seed)
        _save(sd, tmp_path / run / "s0", incremental=True)
        _train_step(sd, 1)
        _save(sd, tmp_path / run / "s1", base=tmp_path / run / "s0")
        runs[run] = clone_state(sd)
    reader = LocalReader(tmp_path / "a" / "s1")
    for run in ("a", "b"):
        out = load_target(runs[run])
        dcp.load(out, storage_reader=reader, checkpoint_id=tmp_path / run / "s1", no_dist=True)
        assert_bit_exact(out, runs[run])


def test_a_save_of_nothing_but_references_leaves_no_empty_file(tmp_path):
    sd = {"frozen": torch.arange(1 << 19, dtype=torch.float32), "step": 1}
    _save(sd, tmp_path / "s0", incremental=True)
    sd["step"] = 2
    _save(sd, tmp_path / "s1", base=tmp_path / "s0")

    rec = read_record_json(tmp_path / "s1")
    named = {e["file"] for e in rec["extents"] if "base" not in e}
    assert {p.name for p in (tmp_path / "s1").glob("*.dcpp")} == named


def test_a_record_larger_than_readers_accept_is_never_committed(tmp_path, monkeypatch):
    import dcp_plus.writers.base as writer_base

    monkeypatch.setattr(writer_base, "MAX_RECORD_BYTES", 2000)  # 1 GiB of record, in small
    with pytest.raises(CheckpointException) as info:
        _save(_state(), tmp_path / "s0", incremental=True)
    ((error, _),) = info.value.failures.values()
    assert "more than readers accept" in str(error)
    assert not (tmp_path / "s0" / ".metadata").exists()
