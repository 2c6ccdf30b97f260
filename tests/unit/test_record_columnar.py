"""The columnar commit record (version 4, written for records of many items) read as
untrusted input: the rich checkpoint of ``test_record_fuzz`` saved columnar, mutated field by
field and row by row, must be refused clearly or load bit-exact; hand-made edits are refused
naming the column and the row; and it decodes to the same ``Metadata`` as the row form."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dcp_plus.format.record as record_module
from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.record import COLUMNAR_VERSION, decode_record, encode_record
from tests.conftest import read_record_json, seal_record
from tests.unit._untrusted import load_outcome, save_rich
from tests.unit.test_record_fuzz import FAST, VALUES, Rich, _check, _paths


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> Rich:
    path = tmp_path_factory.mktemp("columnar") / "ckpt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(record_module, "COLUMNAR_MIN_ITEMS", 1)
        state = save_rich(path)
    record = read_record_json(path)
    assert record["version"] == COLUMNAR_VERSION
    return Rich((path, state, record))


def _rows(rec: dict[str, Any]) -> int:
    return len(rec["extents"]["item"])


@st.composite
def mutants(draw: st.DrawFn, record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rec = copy.deepcopy(record)
    cols = rec["extents"]
    op = draw(st.sampled_from(["set", "set", "set", "delete", "move_extent", "swap_rows",
                               "duplicate_row", "drop_row", "retarget_row"]))
    if op != "set" and op != "delete":
        i, j = draw(st.integers(0, _rows(rec) - 1)), draw(st.integers(0, _rows(rec) - 1))
        if op == "move_extent":  # another row's location and checksum
            for key in ("file", "offset", "checksum"):
                cols[key][i] = cols[key][j]
        elif op == "swap_rows":
            for key in ("file", "offset", "checksum"):
                cols[key][i], cols[key][j] = cols[key][j], cols[key][i]
        elif op == "duplicate_row":
            for col in cols.values():
                col.append(copy.deepcopy(col[i]))
        elif op == "drop_row":
            for col in cols.values():
                col.pop(i)
        else:  # the row names another item
            cols["item"][i] = cols["item"][j]
        return f"{op} {i} {j}", rec
    path = draw(st.sampled_from([p for p in _paths(rec) if p and p[0] != "record_checksum"]))
    parent = rec
    for key in path[:-1]:
        parent = parent[key]
    if op == "delete":
        if isinstance(parent, list):
            parent.pop(path[-1])
        else:
            del parent[path[-1]]
    else:
        parent[path[-1]] = draw(VALUES)
    return f"{op} {'.'.join(map(str, path))}", rec


@FAST
@given(data=st.data())
def test_mutated_columnar_records_are_refused_or_load_bit_exact(rich, capsys, data):
    path, state, _ = rich
    what, rec = data.draw(mutants(rich[2]))
    try:
        sealed = seal_record(rec)
    except (TypeError, ValueError, UnicodeEncodeError):  # not serializable as JSON: moot
        return
    _check(path, state, what, sealed, capsys)


def test_the_unmutated_columnar_record_loads_bit_exact(rich):
    path, state, record = rich
    path.joinpath(".metadata").write_bytes(seal_record(record))
    assert load_outcome(path, state) == ("exact", "")


def test_columnar_and_row_forms_decode_to_the_same_metadata(rich, monkeypatch):
    md = decode_record(seal_record(rich[2]), "c")
    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 10**9)
    row_form = encode_record(md, md.storage_data)
    assert b'"version":4' not in row_form
    again = decode_record(row_form, "r")
    assert again.state_dict_metadata == md.state_dict_metadata
    assert again.storage_data == md.storage_data
    assert again.planner_data == md.planner_data
    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 1)
    assert encode_record(again, again.storage_data) == seal_record(rich[2])


def _edit(record: dict[str, Any], *steps: Any, value: Any) -> dict[str, Any]:
    rec = copy.deepcopy(record)
    parent = rec
    for key in steps[:-1]:
        parent = parent[key]
    parent[steps[-1]] = value
    return rec


def _tensor_row(rec: dict[str, Any], fqn: str) -> int:
    item = rec["items"]["fqn"].index(fqn)
    return rec["extents"]["item"].index(item)


CASES = {
    # name: (edit of the record, text the refusal must contain)
    "unknown_dtype": (lambda r: _edit(r, "dtypes", 0, value="float128"), "'dtypes[0]'"),
    "dtype_code_out_of_range": (lambda r: _edit(r, "items", "dtype", 0, value=99),
                                "'items.dtype[0]'"),
    "short_column": (lambda r: _edit(r, "extents", "length",
                                     value=r["extents"]["length"][:-1]), "'extents.length'"),
    "path_escape": (lambda r: _edit(r, "files", 0, value="../outside.dcpp"), "'files[0]'"),
    "file_index_out_of_range": (lambda r: _edit(r, "extents", "file", 0, value=7),
                                "'extents.file[0]'"),
    "negative_offset": (lambda r: _edit(r, "extents", "offset", 0, value=-1),
                        "'extents.offset[0]'"),
    "bad_checksum": (lambda r: _edit(r, "extents", "checksum", 0, value="xxh3-64:00"),
                     "'extents.checksum[0]'"),
    "chunk_outside_tensor": (lambda r: _edit(
        _edit(r, "extents", "offsets", _tensor_row(r, "w"), value=[64, 0]),
        "extents", "sizes", _tensor_row(r, "w"), value=[64, 32]), "does not fit"),
    "offsets_without_sizes": (lambda r: _edit(r, "extents", "offsets", _tensor_row(r, "w"),
                                              value=[0, 0]), "both lists or both null"),
    "duplicate_fqn": (lambda r: _edit(r, "items", "fqn", 1, value=r["items"]["fqn"][0]),
                      "listed twice"),
    "unknown_column": (lambda r: _edit(r, "extents", "ghost", value=[]),
                       "'extents.ghost'"),
    "bad_prefix": (lambda r: _edit(r, "prefixes", value=["../x"] * len(r["files"])),
                   "'prefixes[0]'"),
    # found by the column check, named by the shared row walk
    "raw_length_not_the_chunks": (lambda r: _edit(
        r, "extents", "raw_length", _tensor_row(r, "w"),
        value=r["extents"]["raw_length"][_tensor_row(r, "w")] + 4), "bytes, but chunk"),
    "tensor_with_a_value_kind": (lambda r: _edit(
        r, "extents", "value", value=[None] * _tensor_row(r, "w") + ["bytesio"] + [None] * (
            len(r["extents"]["item"]) - _tensor_row(r, "w") - 1)),
        "tensor extents have no value kind"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_edited_columnar_record_is_refused_naming_the_column(rich, case):
    edit, expected = CASES[case]
    with pytest.raises(CheckpointFormatError) as info:
        decode_record(seal_record(edit(rich[2])), "/c/.metadata")
    assert "/c/.metadata" in str(info.value) and expected in str(info.value), str(info.value)


def test_aliased_rows_are_refused_by_the_shared_rules(rich):
    rec = copy.deepcopy(rich[2])
    cols = rec["extents"]
    a, b = _tensor_row(rec, "w"), _tensor_row(rec, "ids")
    cols["file"][b], cols["offset"][b] = cols["file"][a], cols["offset"][a]
    with pytest.raises(CheckpointFormatError, match="are also those of"):
        decode_record(seal_record(rec), "/c/.metadata")


def test_rows_in_file_order_overlapping_by_one_byte_are_refused(rich):
    """The writer records extents in file order, which the decoder checks in a few C-level
    passes; an overlap there is handed to the shared rule, which names both items."""
    rec = copy.deepcopy(rich[2])
    cols = rec["extents"]
    rows = [r for r in range(_rows(rec)) if cols["length"][r]]
    assert rows == sorted(rows, key=lambda r: (cols["file"][r], cols["offset"][r]))
    a, b = next((a, b) for a, b in zip(rows, rows[1:], strict=False)
                if cols["file"][a] == cols["file"][b])
    cols["offset"][b] = cols["offset"][a] + cols["length"][a] - 1  # still in order
    with pytest.raises(CheckpointFormatError, match="are also those of"):
        decode_record(seal_record(rec), "/c/.metadata")


@pytest.mark.parametrize("case, decided", [
    ("in order", True), ("touching", True), ("empty extent inside another", True),
    ("two files", True), ("overlap", False), ("out of order", False), ("a reference", False)])
def test_in_order_and_apart_decides_only_what_its_passes_can(case, decided):
    from dcp_plus.format.column_checks import in_order_and_apart

    file, offset, length = [0, 0, 0, 1], [0, 4096, 8192, 0], [4096, 4096, 10, 4096]
    base: list[Any] = [None] * 4
    if case == "touching":
        length[1] = 4096
    elif case == "empty extent inside another":
        file.insert(1, 0), offset.insert(1, 100), length.insert(1, 0), base.append(None)
    elif case == "two files":
        offset[3] = 0
    elif case == "overlap":
        length[1] = 4097
    elif case == "out of order":
        offset[0], offset[1] = offset[1], offset[0]
    elif case == "a reference":
        base[2] = "step_1"
    cols = {"file": file, "offset": offset, "length": length, "base": base}
    assert in_order_and_apart(([], [], [], cols)) is decided


def test_small_records_keep_the_row_form(tmp_path: Path):
    path = tmp_path / "ckpt"
    save_rich(path)
    assert read_record_json(path)["version"] == 2


def test_a_ranks_extent_table_round_trips_and_is_checked(rich):
    from dcp_plus.format.extent_columns import decode_extent_table, encode_extent_table

    extents = decode_record(seal_record(rich[2]), "c").storage_data
    data = encode_extent_table(extents)
    assert decode_extent_table(data, "t") == extents
    rec = json.loads(data)
    rec["extents"]["chunk"][0] = [-1]
    with pytest.raises(CheckpointFormatError, match="'extents.chunk\\[0\\]'"):
        decode_extent_table(json.dumps(rec).encode(), "/c/__1.x.extents")
    rec = json.loads(data)
    rec["extents"]["fqn"][1] = rec["extents"]["fqn"][0]
    rec["extents"]["chunk"][1] = rec["extents"]["chunk"][0]
    with pytest.raises(CheckpointFormatError, match="two extents"):
        decode_extent_table(json.dumps(rec).encode(), "/c/__1.x.extents")


def _two_rank_tables(extents: dict[Any, Any]) -> tuple[bytes, bytes]:
    """``extents`` split by data file into two ranks' extent tables."""
    from dcp_plus.format.extent_columns import encode_extent_table

    files = sorted({e.file for e in extents.values()})
    first = set(files[: len(files) // 2])
    return (encode_extent_table({i: e for i, e in extents.items() if e.file in first}),
            encode_extent_table({i: e for i, e in extents.items() if e.file not in first}))


def test_the_coordinators_extent_columns_encode_the_same_record_as_rows(rich, monkeypatch):
    from dcp_plus.format.extent_set import ExtentSet

    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 1)
    md = decode_record(seal_record(rich[2]), "c")
    a, b = _two_rank_tables(md.storage_data)
    columns = ExtentSet()
    assert columns.add_table(a, "a") + columns.add_table(b, "b") == len(md.storage_data)
    columns.check_unique("c")
    assert columns._rows is None  # nothing built per extent so far
    record = encode_record(md, columns)
    assert columns._rows is None
    assert record == encode_record(md, dict(columns))
    assert decode_record(record, "c").storage_data == md.storage_data


def test_extent_tables_naming_one_file_or_one_item_twice_are_refused(rich):
    from dcp_plus.format.extent_columns import encode_extent_table
    from dcp_plus.format.extent_set import ExtentSet

    extents = decode_record(seal_record(rich[2]), "c").storage_data
    a, _ = _two_rank_tables(extents)
    columns = ExtentSet()
    columns.add_table(a, "/c/__0.x.extents")
    with pytest.raises(CheckpointFormatError, match="__1.x.extents: data file .* another"):
        columns.add_table(a, "/c/__1.x.extents")
    index, ext = next(iter(extents.items()))
    columns = ExtentSet()
    columns.add_table(a, "/c/__0.x.extents")
    columns.add_table(encode_extent_table({index: ext._replace(file="other")}), "/c/__1.x")
    with pytest.raises(CheckpointFormatError, match=f"/c/tables: {index.fqn!r} .*two extents"):
        columns.check_unique("/c/tables")


def test_an_extent_tables_zero_offsets_are_a_count_and_a_bad_count_is_refused(rich):
    from dcp_plus.format.extent_columns import decode_extent_table, encode_extent_table

    extents = decode_record(seal_record(rich[2]), "c").storage_data
    data = encode_extent_table(extents)
    rec = json.loads(data)
    zero = [i for i, c in enumerate(rec["extents"]["chunk"]) if type(c) is int]
    assert zero and all(not any(list(extents)[i].offset) for i in zero)
    assert decode_extent_table(data, "t") == extents
    for bad in (65, -1, True):
        rec["extents"]["chunk"][zero[0]] = bad
        with pytest.raises(CheckpointFormatError, match=f"'extents.chunk\\[{zero[0]}\\]'"):
            decode_extent_table(json.dumps(rec).encode(), "/c/__1.x.extents")


def _with_memo(md: Any, memo: Any) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_plus.format.record_memo import MEMO_ATTRIBUTE

    out = Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=md.planner_data,
                   storage_meta=md.storage_meta, version=md.version)
    setattr(out, MEMO_ATTRIBUTE, memo)
    return out


def test_a_memoized_record_has_the_bytes_of_a_fresh_one_save_after_save(rich, monkeypatch):
    """The structure's part and the chunk columns come from the memo at the second save,
    the chunk columns are encoded again when the extents come in another order, and every
    record is byte for byte the one encoded without a memo."""
    from dcp_plus.format.extent_set import ExtentSet
    from dcp_plus.format.record_memo import RecordMemo

    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 1)
    md = decode_record(seal_record(rich[2]), "c")
    assert md.planner_data  # nested keys: the planner paths are memoized too
    a, b = _two_rank_tables(md.storage_data)
    memo = RecordMemo()
    for tables in ([a, b], [a, b], [b, a]):
        columns = ExtentSet()
        for i, t in enumerate(tables):
            columns.add_table(t, str(i))
        before = memo.chunks
        assert encode_record(_with_memo(md, memo), columns) == encode_record(md, columns)
        assert memo.structure is not None and memo.chunks is not None
        assert (memo.chunks is before) == (tables == [a, b] and before is not None)
    assert encode_record(_with_memo(md, memo), md.storage_data) == encode_record(
        md, md.storage_data)  # the rows of a one-rank save, in the order of the columns


def test_a_memo_never_hides_a_chunk_without_its_extent(rich, monkeypatch):
    from dcp_plus.format.record_memo import RecordMemo

    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 1)
    md = decode_record(seal_record(rich[2]), "c")
    memo = RecordMemo()
    encode_record(_with_memo(md, memo), md.storage_data)
    fewer = dict(list(md.storage_data.items())[1:])
    with pytest.raises(CheckpointFormatError, match="every chunk and value has exactly one"):
        encode_record(_with_memo(md, memo), fewer)
