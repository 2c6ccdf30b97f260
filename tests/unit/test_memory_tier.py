"""The memory tier in one process: restore bit-exact from shared memory, records refused when
torn or edited, a changed structure falls back to durable storage, close() cleans up."""

from __future__ import annotations

import io
import os
import re
import uuid

import pytest
import torch

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.piece_digest import PIECE_BYTES
from dcp_plus.manager import CheckpointManager
from dcp_plus.tiers import names
from dcp_plus.tiers.record import read


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"m": {"w": torch.randn(300, 70, generator=g),
                  "b": torch.randn(9, generator=g).to(torch.bfloat16),
                  "i": torch.arange(step, step + 5, dtype=torch.int64),
                  "t": torch.randn(6, 4, generator=g).t(), "e": torch.empty(0, 3)},
            "step": step, "blob": io.BytesIO(b"s%d" % step)}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["m"][k], b["m"][k]) for k in b["m"]) and a["step"] == b["step"] \
        and a["blob"].getvalue() == b["blob"].getvalue()


@pytest.fixture
def job():
    job_id = f"u{uuid.uuid4().hex[:12]}"
    yield job_id
    for f in names.listing(job_id):
        names.unlink(f.name)


def _saved(root, job, steps=(1, 2, 3)) -> CheckpointManager:
    m = CheckpointManager(root, memory_tier=True, durable_every=2, job_id=job, takeover=True)
    for s in steps:
        m.save(s, _state(s)).result(timeout=60)
    return m


def _assert_restores(root, job, step: int, tier: str) -> None:
    """A new manager on ``root`` restores ``step`` bit-exact from ``tier``, then closes."""
    m = CheckpointManager(root, memory_tier=True, job_id=job)
    st = _state(0)
    assert m.load_latest(st) == step
    assert m.last_restore is not None and m.last_restore.tiers == [tier]
    assert _equal(st, _state(step))
    m.close()


def test_a_new_manager_restores_the_newest_snapshot_from_memory(tmp_path, job):
    m = _saved(tmp_path / "r", job)
    assert [c.step for c in m.list()] == [1, 3]  # the 1st and 3rd saves are durable
    records = [f for f in names.listing(job) if f.kind == "record"]
    assert [f.step for f in records] == [3]  # older snapshots are dropped
    m.close(keep_snapshots=True)
    _assert_restores(tmp_path / "r", job, 3, "memory")
    assert names.listing(job) == []


def test_a_record_cut_by_a_kill_before_its_rename_is_never_read_and_then_removed(tmp_path,
                                                                                  job):
    """A process killed inside ``TierRecord.write`` leaves the record's temporary file: the
    restart restores the snapshot before it, and its manager removes that file."""
    m = _saved(tmp_path / "root", job, steps=(1, 2))
    m.close(keep_snapshots=True)
    (record,) = [f for f in names.listing(job) if f.kind == "record"]
    partial = os.path.join(os.path.dirname(record.path),
                           f".{names.record_name(job, 0, 0, 3)}.999999999.tmp")
    with open(record.path, "rb") as src, open(partial, "wb") as dst:
        dst.write(src.read()[:100])  # cut short, as a kill leaves it
    assert [f.kind for f in names.listing(job) if f.step == 3] == ["partial"]
    _assert_restores(tmp_path / "root", job, 2, "memory")
    assert not os.path.exists(partial)
    assert names.listing(job) == []


def test_a_changed_structure_skips_the_memory_tier(tmp_path, job):
    _saved(tmp_path / "r", job).close(keep_snapshots=True)
    m2 = CheckpointManager(tmp_path / "r", memory_tier=True, job_id=job)
    st = _state(0)
    st["m"]["w"] = torch.zeros(300, 71)  # another shape: the durable checkpoint cannot load
    st["m"].pop("e")
    st2 = _state(0)
    st2["m"]["extra"] = torch.zeros(3)
    assert m2.load_latest(_state(0)) == 3  # sanity: same structure, from memory
    m2.close(keep_snapshots=True)
    m3 = CheckpointManager(tmp_path / "r", memory_tier=True, job_id=job)
    s = {"m": {k: v for k, v in _state(0)["m"].items() if k != "e"}, "step": 0,
         "blob": io.BytesIO()}
    assert m3.load_latest(s) == 3
    assert m3.last_restore is not None and m3.last_restore.tiers == ["durable"]
    m3.close()


@pytest.mark.parametrize("damage", ["torn", "edited"])
def test_a_damaged_record_is_refused_and_the_durable_checkpoint_used(tmp_path, job, damage):
    _saved(tmp_path / "r", job).close(keep_snapshots=True)
    rec = next(f for f in names.listing(job) if f.kind == "record")
    with open(rec.path, "rb") as f:
        data = f.read()
    data = data[: len(data) // 2] if damage == "torn" else data.replace(b'"step":3', b'"step":4')
    with open(rec.path, "wb") as f:
        f.write(data)
    with pytest.raises(CheckpointFormatError, match="record_checksum"):
        read(rec)
    _assert_restores(tmp_path / "r", job, 3, "durable")


def test_damaged_snapshot_bytes_are_detected_and_not_loaded(tmp_path, job):
    m = _saved(tmp_path / "r", job, steps=(1, 2))  # step 2 is in memory only
    link = next(f for f in names.listing(job) if f.kind == "link")
    with open(link.path, "r+b") as f:
        f.write(b"\xff" * 64)
    m.close(keep_snapshots=True)
    m2 = CheckpointManager(tmp_path / "r", memory_tier=True, job_id=job)
    st = _state(0)
    assert m2.load_latest(st) == 1  # not the damaged step 2: the durable step 1
    assert _equal(st, _state(1))
    m2.close()


@pytest.mark.parametrize("damaged", [False, True])
def test_a_tensor_of_several_checksum_pieces_restores_and_a_damaged_piece_is_caught(
        tmp_path, job, damaged):
    big = {"big": torch.arange(PIECE_BYTES // 4 + 4096, dtype=torch.float32)}
    m = CheckpointManager(tmp_path / "r", memory_tier=True, durable_every=2, job_id=job)
    for s in (1, 2):  # step 2 is in memory only
        m.save(s, {"m": {"big": big["big"] + s}}).result(timeout=60)
    (rec,) = [read(f) for f in names.listing(job) if f.kind == "record"]
    (entry,) = rec.entries
    if damaged:
        with open(os.path.join(names.SHM_DIR, entry.file), "r+b") as f:
            f.seek(entry.offset + PIECE_BYTES + 100)  # in the second piece
            f.write(b"\xff")
    m.close(keep_snapshots=True)
    m2 = CheckpointManager(tmp_path / "r", memory_tier=True, job_id=job)
    st = {"m": {"big": torch.zeros_like(big["big"])}}
    assert m2.load_latest(st) == (1 if damaged else 2)
    assert m2.last_restore.tiers == ["durable" if damaged else "memory"]
    assert torch.equal(st["m"]["big"], big["big"] + (1 if damaged else 2))
    m2.close()


def test_a_newer_snapshot_of_another_world_size_is_removed_and_durable_storage_used(
        tmp_path, job):
    from dcp_plus.stagers import ArenaStager
    from dcp_plus.tiers.memory import MemoryTier

    _saved(tmp_path / "r", job).close(keep_snapshots=True)
    with ArenaStager(buffers=2) as stager:  # rank 0's step 5 of the same job on 2 ranks
        MemoryTier(job, 0, 2).take(5, stager.stage(_state(5)).result(timeout=60))
    assert [f.step for f in names.listing(job) if f.kind == "record"] == [5]
    _assert_restores(tmp_path / "r", job, 3, "durable")  # 1 rank now: step 5 is not used
    assert names.listing(job) == []


def test_the_memory_tier_refuses_a_stager_with_one_buffer(tmp_path, job):
    from dcp_plus.stagers import ArenaStager

    with ArenaStager(buffers=1) as stager, pytest.raises(ValueError, match="buffers=2"):
        CheckpointManager(tmp_path / "r", memory_tier=True, job_id=job, stager=stager)


def test_peer_tier_settings_are_checked(tmp_path, job):
    with pytest.raises(ValueError, match="memory_tier"):
        CheckpointManager(tmp_path / "r", peer_tier=True, job_id=job)
    with pytest.raises(ValueError, match="durable_every"):
        CheckpointManager(tmp_path / "r", memory_tier=True, durable_every=0, job_id=job)
    assert not os.path.exists(tmp_path / "r" / "step_00000001")


@pytest.mark.parametrize(("partner", "message"), [
    (lambda r: r, "rank 0 is its own partner"),
    (lambda r: 0 if r else 1, "not a permutation"),
    (lambda r: r + 1, "partner(3) = 4 is not a rank of 0..3"),
    (lambda r: float(r ^ 1), "partner(0) = 1.0 is not a rank"),
])
def test_a_bad_partner_function_is_refused_naming_the_rank(partner, message):
    from dcp_plus.tiers.peer import check_partner

    with pytest.raises(ValueError, match=re.escape(message)):
        check_partner(partner, 4)
    assert check_partner(lambda r: 3 - r, 4) == [3, 2, 1, 0]


def test_gc_shm_removes_a_finished_jobs_snapshots_but_not_a_live_ones(tmp_path, job):
    from dcp_plus.cli.gc import collect
    from dcp_plus.errors import DcpPlusError

    m = _saved(tmp_path / "r", job)
    with pytest.raises(DcpPlusError, match="in use"):
        collect(str(tmp_path / "r"), shm=True, job_id=job)
    m.close(keep_snapshots=True)
    held = sorted(f.name for f in names.listing(job))
    assert held
    assert collect(str(tmp_path / "r"), shm=True, job_id=job, dry_run=True)["shm"] == held
    assert sorted(f.name for f in names.listing(job)) == held  # a dry run removes nothing
    assert collect(str(tmp_path / "r"), shm=True, job_id=job)["shm"] == held
    assert names.listing(job) == []
