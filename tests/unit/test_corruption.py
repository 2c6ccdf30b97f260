"""Invariant 4: corrupted or truncated data files are detected at load, naming file and tensor."""

from __future__ import annotations

import os
import random

import pytest
import torch

from dcp_plus import LocalReader
from dcp_plus.errors import CheckpointFormatError, CheckpointNotFoundError, CorruptCheckpointError
from dcp_plus.format.record import Extent
from dcp_plus.readers.extents import check_extent_bounds, verify_checksum
from dcp_plus.storage.fileio import read_coalesced
from dcp_plus.storage.localfs import LocalFileStore
from tests.conftest import (
    assert_bit_exact,
    build_state_dict,
    clone_state,
    flip_byte,
    load,
    load_fails,
    load_target,
    read_record_json,
    save,
    write_record_json,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint of the full state dict, restored after every test that damages it."""
    sd = build_state_dict(seed=3)
    path = tmp_path_factory.mktemp("corrupt") / "ckpt"
    save(sd, path)
    return path, clone_state(sd)


def _positions(extent: dict, rng: random.Random) -> list[int]:
    start, n = extent["offset"], extent["length"]
    picks = {start, start + n // 2, start + n - 1, start + rng.randrange(n)}
    return sorted(picks)


def test_flipped_byte_in_any_extent_is_reported_with_file_and_tensor(saved):
    path, expected = saved
    extents = [e for e in read_record_json(path)["extents"] if e["length"]]
    rng = random.Random(0)
    checked = 0
    for ext in extents:
        for pos in _positions(ext, rng):
            flip_byte(path / ext["file"], pos)
            try:
                msg = load_fails(load_target(expected), path)
            finally:
                flip_byte(path / ext["file"], pos)
            assert "CorruptCheckpointError" in msg and "checksum mismatch" in msg, msg
            assert repr(ext["fqn"]) in msg, (ext["fqn"], pos, msg)
            assert str(path / ext["file"]) in msg, msg
            checked += 1
    assert checked >= 3 * len(extents) > 90
    # and the repaired checkpoint loads again
    assert_bit_exact(load(load_target(expected), path), expected)


def test_flip_in_a_non_tensor_value_is_reported_with_its_key(saved):
    path, expected = saved
    (ext,) = [e for e in read_record_json(path)["extents"] if e["fqn"] == "opt.param_groups.0.name"]
    flip_byte(path / ext["file"], ext["offset"] + ext["length"] - 3)
    try:
        msg = load_fails(load_target(expected), path)
    finally:
        flip_byte(path / ext["file"], ext["offset"] + ext["length"] - 3)

    assert "'opt.param_groups.0.name'" in msg and "checksum mismatch" in msg


def _last_extent(path):
    return max(read_record_json(path)["extents"], key=lambda e: (e["file"], e["offset"]))


@pytest.mark.parametrize("cut", ["empty", "inside_last_extent", "before_last_extent"])
def test_truncated_data_file_is_reported_with_file_and_tensor(tmp_path, cut):
    sd = build_state_dict(seed=4)
    save(sd, tmp_path / "ckpt")
    last = _last_extent(tmp_path / "ckpt")
    size = {"empty": 0, "inside_last_extent": last["offset"] + last["length"] - 1,
            "before_last_extent": last["offset"]}[cut]
    os.truncate(tmp_path / "ckpt" / last["file"], size)

    msg = load_fails(load_target(sd), tmp_path / "ckpt")

    assert "CheckpointFormatError" in msg and "truncated" in msg, msg
    assert str(tmp_path / "ckpt" / last["file"]) in msg
    if cut != "empty":
        assert repr(last["fqn"]) in msg, msg


def test_truncated_file_is_detected_without_checksum_verification(tmp_path):
    sd = build_state_dict(seed=4)
    save(sd, tmp_path / "ckpt")
    last = _last_extent(tmp_path / "ckpt")
    os.truncate(tmp_path / "ckpt" / last["file"], last["offset"] + 1)

    msg = load_fails(load_target(sd), tmp_path / "ckpt", verify=False)

    assert repr(last["fqn"]) in msg and "truncated" in msg


def test_missing_data_file_is_reported(tmp_path):
    sd = build_state_dict(seed=4)
    save(sd, tmp_path / "ckpt")
    last = _last_extent(tmp_path / "ckpt")
    os.unlink(tmp_path / "ckpt" / last["file"])

    msg = load_fails(load_target(sd), tmp_path / "ckpt")

    assert "missing" in msg and last["file"] in msg


def test_record_extent_past_end_of_file_names_field_file_and_tensor(tmp_path):
    sd = build_state_dict(seed=4)
    save(sd, tmp_path / "ckpt")
    rec = read_record_json(tmp_path / "ckpt")
    i, ext = next((i, e) for i, e in enumerate(rec["extents"]) if e["fqn"] == "dtypes.int64")
    ext["offset"] = os.path.getsize(tmp_path / "ckpt" / ext["file"]) - ext["length"] + 8
    write_record_json(tmp_path / "ckpt", rec)

    msg = load_fails(load_target(sd), tmp_path / "ckpt")

    assert f"extents[{i}]" in msg and "'dtypes.int64'" in msg and ext["file"] in msg, msg


def test_record_extent_length_not_matching_tensor_is_refused(tmp_path):
    sd = build_state_dict(seed=4)
    save(sd, tmp_path / "ckpt")
    rec = read_record_json(tmp_path / "ckpt")
    ext = next(e for e in rec["extents"] if e["fqn"] == "dtypes.float64")
    ext["length"] -= 8
    ext["raw_length"] -= 8
    write_record_json(tmp_path / "ckpt", rec)

    msg = load_fails(load_target(sd), tmp_path / "ckpt")

    # refused with the record, before any data is read (DCP reports its message, not its type)
    assert "'dtypes.float64'" in msg and "raw_length" in msg and ".metadata" in msg


# The `dcp-plus verify` command reuses these helpers directly.


def test_verify_checksum_names_file_and_item(tmp_path):
    ext = Extent("__0_0.ab.dcpp", 4096, 3, 3, "identity", "xxh3-64:0000000000000000")

    with pytest.raises(CorruptCheckpointError) as info:
        verify_checksum(memoryview(b"abc"), ext, "tensor 'w'", str(tmp_path), "w")

    assert str(tmp_path / "__0_0.ab.dcpp") in str(info.value) and "tensor 'w'" in str(info.value)
    with pytest.raises(CheckpointFormatError, match="unsupported checksum"):
        verify_checksum(memoryview(b"abc"), Extent("f", 0, 3, 3, "identity", "md5:00"), "x",
                        str(tmp_path), "x")


def test_check_bounds_reports_extent_index_and_file(tmp_path):
    (tmp_path / "f.dcpp").write_bytes(b"x" * 100)
    ok = Extent("f.dcpp", 0, 100, 100, "identity", "xxh3-64:0")
    past = Extent("f.dcpp", 96, 8, 8, "identity", "xxh3-64:0")

    store = LocalFileStore(str(tmp_path))

    def check_bounds(extents: list[tuple[str, Extent]]) -> None:
        sizes = store.sizes(sorted({e.file for _, e in extents}))
        check_extent_bounds(extents, sizes.__getitem__, store.location)

    check_bounds([("tensor 'a'", ok)])
    with pytest.raises(CheckpointFormatError) as info:
        check_bounds([("tensor 'a'", ok), ("tensor 'b'", past)])

    assert "extents[1]" in str(info.value) and "tensor 'b'" in str(info.value)


def test_short_read_raises_eof_naming_the_file(tmp_path):
    f = tmp_path / "short.dcpp"
    f.write_bytes(bytes(range(256)) * 20)
    a, b = bytearray(100), bytearray(5000)
    fd = os.open(f, os.O_RDONLY)
    try:
        read_coalesced(fd, str(f), [(0, memoryview(a))])
        assert bytes(a) == bytes(range(100))
        with pytest.raises(EOFError, match=str(f)):
            read_coalesced(fd, str(f), [(200, memoryview(a)), (1000, memoryview(b))])
    finally:
        os.close(fd)


def test_directory_without_commit_record_is_not_a_checkpoint(tmp_path):
    sd = {"w": torch.ones(2)}
    save(sd, tmp_path / "ckpt")
    os.unlink(tmp_path / "ckpt" / ".metadata")  # what an interrupted save leaves

    with pytest.raises(CheckpointNotFoundError, match="no commit record"):
        LocalReader(tmp_path / "ckpt").read_metadata()
    assert "no commit record" in load_fails(load_target(sd), tmp_path / "ckpt")
