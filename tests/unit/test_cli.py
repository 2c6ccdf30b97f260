"""`dcp-plus inspect` and `dcp-plus verify`, run as the installed command would run them."""

from __future__ import annotations

import json
import os
import random

import pytest

from dcp_plus.cli.main import main
from tests.conftest import build_state_dict, flip_byte, read_record_json, save


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    save(build_state_dict(), path)
    return path


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_inspect_lists_every_tensor_with_dtype_shape_bytes_codec_and_file(saved, capsys):
    rc, info = run_json(capsys, "inspect", str(saved))
    assert rc == 0
    record = read_record_json(saved)
    assert len(info["items"]) == len(record["extents"])
    by_name = {r["name"]: r for r in info["items"]}
    for fqn, item in record["items"].items():
        if item["kind"] == "tensor":
            row = by_name[fqn]
            assert row["dtype"] == item["dtype"] and row["shape"] == item["size"]
            assert row["codec"] == "identity" and (saved / row["file"]).exists()
    totals = info["totals"]
    assert totals["bytes"] == sum(e["raw_length"] for e in record["extents"])
    assert totals["files"] == len({e["file"] for e in record["extents"]})
    assert main(["inspect", str(saved)]) == 0
    assert "tensors" in capsys.readouterr().out


def test_verify_passes_on_an_intact_checkpoint(saved, capsys):
    rc, report = run_json(capsys, "verify", str(saved))
    assert rc == 0 and report["ok"] and not report["problems"]
    assert report["extents"] == len(read_record_json(saved)["extents"])


def test_verify_exits_1_naming_file_and_tensor_for_a_flipped_byte(saved, capsys):
    ext = max(read_record_json(saved)["extents"], key=lambda e: e["length"])
    flip_byte(saved / ext["file"], ext["offset"] + random.Random(1).randrange(ext["length"]))
    rc, report = run_json(capsys, "verify", str(saved))
    assert rc == 1 and not report["ok"]
    (problem,) = report["problems"]
    assert ext["file"] in problem and repr(ext["fqn"]) in problem


def test_verify_reports_damaged_padding_between_extents(saved, capsys):
    exts = sorted(read_record_json(saved)["extents"], key=lambda e: (e["file"], e["offset"]))
    gap = next(e for e in exts if e["length"] % 4096)  # an extent followed by padding
    flip_byte(saved / gap["file"], gap["offset"] + gap["length"])
    rc, report = run_json(capsys, "verify", str(saved))
    assert rc == 1 and "padding" in report["problems"][0] and gap["file"] in report["problems"][0]


def test_verify_reports_a_truncated_file_naming_the_tensor(saved, capsys):
    ext = max((e for e in read_record_json(saved)["extents"] if e["length"]),
              key=lambda e: e["offset"] + e["length"])
    os.truncate(saved / ext["file"], ext["offset"] + ext["length"] - 1)
    rc, report = run_json(capsys, "verify", str(saved))
    assert rc == 1
    assert any("truncated" in p and repr(ext["fqn"]) in p for p in report["problems"])


def test_cli_refuses_a_directory_without_commit_record(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "no commit record" in capsys.readouterr().err
