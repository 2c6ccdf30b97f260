"""Version-5 records: parts and references round-trip in both layouts (rows, and columns built
from ranks' extent tables as a multi-rank coordinator does), and every hostile field of a
part is refused naming it before anything is read."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_plus.format.record as record_module
from dcp_plus import LocalReader, LocalWriter
from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.extent_columns import encode_extent_table
from dcp_plus.format.extent_set import ExtentSet
from dcp_plus.format.record import decode_record, encode_record
from tests.conftest import (
    assert_bit_exact,
    clone_state,
    load,
    load_target,
    read_record_json,
    seal_record,
    write_record_json,
)


def _chain(tmp_path: Path, n: int = 1200) -> tuple[Path, dict[str, Any]]:
    """Two links of ``n`` small tensors and one of 3 MiB (columnar from 1,000 items)."""
    sd: dict[str, Any] = {f"t{i}": torch.full((3,), float(i)) for i in range(n)}
    sd["big"] = torch.arange(3 << 18, dtype=torch.float32)
    dcp.save(sd, storage_writer=LocalWriter(tmp_path / "s0", incremental=True), no_dist=True)
    sd["t3"] += 1
    sd["big"][1 << 18] = -1.0  # the second part of three
    dcp.save(sd, storage_writer=LocalWriter(tmp_path / "s1", base=tmp_path / "s0"),
             no_dist=True)
    return tmp_path / "s1", clone_state(sd)


def test_a_columnar_incremental_record_loads_bit_exact(tmp_path):
    child, want = _chain(tmp_path)

    rec = read_record_json(child)
    assert rec["version"] == 5 and rec["layout"] == "columns" and rec["bases"] == ["s0"]
    assert_bit_exact(load(load_target(want), child), want)


def test_parts_cross_ranks_extent_tables_into_the_same_record(tmp_path):
    child, _ = _chain(tmp_path, n=40)
    md = LocalReader(child).read_metadata()
    extents = md.storage_data
    # by own data file, as ranks write them; references to the base's files on both sides
    own = sorted({e.file for e in extents.values() if e.base is None})
    first = {i for i, e in extents.items()
             if e.file == own[0] or (e.base is not None and i.fqn < "t2")}
    assert any(extents[i].base for i in first) and any(
        e.base for i, e in extents.items() if i not in first)
    tables = [encode_extent_table({i: extents[i] for i in first}),
              encode_extent_table({i: e for i, e in extents.items() if i not in first})]
    columns = ExtentSet()
    for k, table in enumerate(tables):
        columns.add_table(table, f"rank {k}")

    record = encode_record(md, columns)

    assert record == encode_record(md, dict(columns))
    assert decode_record(record, "c").storage_data == extents


def _edit(rec: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(rec)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DELETE = object()


@pytest.fixture
def child(tmp_path: Path) -> tuple[Path, dict[str, Any], int]:
    """A row-layout child; the index of its extent of 'big' (own and referenced parts)."""
    path, _ = _chain(tmp_path, n=5)
    rec = read_record_json(path)
    return path, rec, next(i for i, e in enumerate(rec["extents"]) if e["fqn"] == "big")


@pytest.mark.parametrize(("edit", "named"), [
    (("parts", 0, "in"), "../s0"),
    (("parts", 0, "in"), ".hidden"),
    (("parts", 0, "in"), "nope"),  # not one of the bases
    (("parts", 1, "hash"), "xxh3-64:0"),
    (("parts", 1, "raw"), 0),
    (("parts", 1, "offset"), -1),
    (("parts", 1, "length"), 1 << 63),
    (("parts", 1, "codec"), "lz4"),
    (("parts", 1, "file"), "../../etc/passwd"),
    (("parts", 1, "against"), {"hash": "x"}),
    (("parts", 1, "extra"), 1),
    (("parts",), []),
    (("base",), "s0/.."),
    (("codec",), "identity"),  # parts on an uncompressed extent
    (("raw_length",), 12),
])
def test_a_hostile_part_is_refused_naming_the_field(child, edit, named):
    path, rec, row = child
    write_record_json(path, _edit(rec, ("extents", row, *edit), named))

    with pytest.raises(CheckpointFormatError, match=r"extents\[\d+\]"):
        LocalReader(path).read_metadata()


def test_a_delta_chain_deeper_than_128_is_refused(child):
    path, rec, row = child
    part = rec["extents"][row]["parts"][1]
    deep = dict(part, codec="identity")
    for _ in range(130):
        deep = dict(part, codec="xor+zstd+shuffle", against=deep)
    write_record_json(path, _edit(rec, ("extents", row, "parts", 1), deep))

    with pytest.raises(CheckpointFormatError, match="chain of more than 128"):
        LocalReader(path).read_metadata()


def test_parts_in_a_version_4_record_are_refused(child, monkeypatch):
    path, rec, _ = child
    rec = _edit(_edit(rec, ("version",), 3), ("bases",), _DELETE)
    write_record_json(path, _edit(rec, ("layout",), _DELETE))

    with pytest.raises(CheckpointFormatError, match="version-5"):
        LocalReader(path).read_metadata()


def test_the_record_checksum_binds_the_parts_table(child):
    """An edit that keeps every field valid (another part's hash) is still caught."""
    path, rec, row = child
    parts = rec["extents"][row]["parts"]
    edited = _edit(rec, ("extents", row, "parts", 0, "hash"), parts[2]["hash"])
    path.joinpath(".metadata").write_bytes(seal_record(edited))

    from tests.conftest import load_fails
    msg = load_fails(load_target({"big": torch.zeros(3 << 18)}), path)
    assert "checksum mismatch" in msg and "'big'" in msg


def test_the_columnar_minimum_applies_to_incremental_records(monkeypatch, tmp_path):
    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 3)
    path, want = _chain(tmp_path, n=5)
    assert read_record_json(path)["layout"] == "columns"
    assert_bit_exact(load(load_target(want), path), want)
    assert json.loads((path / ".metadata").read_bytes())["bases"] == ["s0"]
