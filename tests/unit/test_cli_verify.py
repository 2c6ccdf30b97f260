"""`dcp-plus verify`'s report, run as the real command: one line per damaged file, named
relative to the checkpoint; appended bytes found; an edited record length blamed on the record."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import LocalWriter
from dcp_plus.format.record import seal
from tests.conftest import read_record_json, write_record_json
from tests.unit.test_cli_ls_diff import run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 small tensors and a compressible large one, zstd-compressed, in 2 data files."""
    path = tmp_path_factory.mktemp("verify") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {f"t{i}": torch.randn(10, generator=gen) for i in range(80)}
    sd["zeros"] = torch.zeros(100_000)
    dcp.save(sd, storage_writer=LocalWriter(path, codec="zstd"), no_dist=True)
    return path


@pytest.fixture
def ckpt(original: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(original, tmp_path / "ckpt"))


def verify(path: Path, *, text: bool = False) -> tuple[int, list[str], str]:
    """Exit code and problems (``--json``), and with ``text`` the plain report too."""
    proc = run("verify", str(path), "--json")
    return (proc.returncode, json.loads(proc.stdout)["problems"],
            run("verify", str(path)).stdout if text else "")


def by_file(path: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in read_record_json(path)["extents"]:
        out.setdefault(e["file"], []).append(e)
    return out


def test_an_intact_checkpoint_says_ok_in_the_singular_and_plural(ckpt: Path) -> None:
    rc, problems, text = verify(ckpt, text=True)
    assert rc == 0 and problems == [] and text.rstrip().endswith("checked: OK"), text
    assert "81 extents" in text


def test_files_no_record_names_are_listed_as_stray_not_as_damage(ckpt: Path) -> None:
    data = sorted(by_file(ckpt))[0]
    rank_k, save_id = data.split(".")[0], data.split(".")[1]
    other = "0" * len(save_id) if save_id != "0" * len(save_id) else "1" * len(save_id)
    shutil.copy(ckpt / data, ckpt / f"{rank_k}.{other}.dcpp")  # an uncommitted save's file
    (ckpt / f"__0.{other}.extents").write_text("{}")  # and its extent table
    (ckpt / "notes.txt").write_text("not a save's file")  # not ours: not listed
    proc = run("verify", str(ckpt), "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["problems"] == []
    assert sorted(report["stray"], key=lambda s: s["file"]) == sorted([
        {"file": f"{rank_k}.{other}.dcpp", "bytes": (ckpt / data).stat().st_size},
        {"file": f"__0.{other}.extents", "bytes": 2}], key=lambda s: s["file"])
    text = run("verify", str(ckpt)).stdout
    assert f"STRAY: {rank_k}.{other}.dcpp" in text and "2 stray files" in text
    assert text.rstrip().endswith("checked: OK"), text


@pytest.mark.parametrize(("record", "decoded"), [
    (seal(b'{"version":5,"bases":["elsewhere"],"damaged":1}'), False),  # references others
    (seal(b'{"version":5,"bases":["ckpt"],"damaged":1}'), True),  # references it: decoded
    (b'{"damaged":"refers to nothing here"}', True),  # its references cannot be told
    (seal(b'{"version":5,"bases":[],"damaged":1}').replace(b"[]", b'["ckpt"]'), True),  # edited
])
def test_only_sibling_records_that_may_name_the_checkpoint_are_decoded(
        ckpt: Path, record: bytes, decoded: bool) -> None:
    data = sorted(by_file(ckpt))[0]
    stray = data.replace(data.split(".")[1], "f" * len(data.split(".")[1]))
    shutil.copy(ckpt / data, ckpt / stray)
    other = ckpt.parent / "other"
    other.mkdir()
    (other / ".metadata").write_bytes(record)  # decoding it fails
    report = json.loads(run("verify", str(ckpt), "--json").stdout)
    assert report["problems"] == []
    if decoded:  # a record that may reference it but cannot be read leaves the files untold
        assert report["stray"] == [] and "other" in report["stray_error"], report
    else:
        assert [s["file"] for s in report["stray"]] == [stray]
        assert report.get("stray_error") is None, report


def test_a_save_file_that_cannot_be_sized_leaves_the_verdict_alone(ckpt: Path) -> None:
    (ckpt / ("__0_0." + "e" * 16 + ".dcpp")).mkdir()  # a directory by a data file's name
    proc = run("verify", str(ckpt), "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["problems"] == [] and report["stray"] == []
    assert "e" * 16 in report["stray_error"], report
    text = run("verify", str(ckpt)).stdout
    assert "could not look for stray files" in text and text.rstrip().endswith("OK"), text


def test_a_truncated_file_is_one_line_naming_its_tensors(ckpt: Path) -> None:
    name, extents = max(by_file(ckpt).items(), key=lambda kv: len(kv[1]))
    os.truncate(ckpt / name, 5000)
    rc, problems, text = verify(ckpt, text=True)
    assert rc == 1
    (line,) = problems  # one line for the file, not one per extent past its end
    assert line.startswith(f"{name}: truncated") and "5000 bytes" in line, line
    past = [e for e in extents if e["offset"] + e["length"] > 5000]
    assert f"{len(past)} extent(s) past its end" in line and repr(past[0]["fqn"]) in line
    assert "FAILED (1 problem)" in text and str(ckpt) + "/" not in line


def test_bytes_appended_after_the_last_extent_are_reported(ckpt: Path) -> None:
    name = next(iter(by_file(ckpt)))
    size = (ckpt / name).stat().st_size
    with open(ckpt / name, "ab") as f:
        f.write(b"\0" * 100)  # even zeros: the writer ends a file at its last extent
    rc, problems, _ = verify(ckpt)
    assert rc == 1 and problems == [
        f"{name}: 100 bytes after the last extent (bytes {size}..{size + 100}): appended, or "
        "the file was replaced"]


def test_damage_in_two_files_is_two_lines(ckpt: Path) -> None:
    files = by_file(ckpt)
    for name, extents in files.items():
        e = max(extents, key=lambda e: e["length"])
        with open(ckpt / name, "r+b") as f:
            f.seek(e["offset"] + e["length"] // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    rc, problems, text = verify(ckpt, text=True)
    assert rc == 1 and len(problems) == len(files) == 2, problems
    assert all("checksum mismatch" in p for p in problems)
    assert "FAILED (2 problems)" in text


@pytest.mark.parametrize("delta", [-10, 10])
def test_an_edited_length_is_blamed_on_the_record_not_the_data(ckpt: Path, delta: int) -> None:
    rec = read_record_json(ckpt)
    ext = next(e for e in rec["extents"] if e["fqn"] == "zeros")
    true = ext["length"]
    ext["length"] += delta
    write_record_json(ckpt, rec)  # resealed: the record's own checksum still matches
    rc, problems, _ = verify(ckpt)
    assert rc == 1
    (line,) = problems
    assert line.startswith(".metadata: ") and "'zeros'" in line, line
    assert f"length of {true + delta} bytes" in line and f"is {true} bytes" in line
    assert "the record was edited, the data is intact" in line
