"""The commit record: JSON that rebuilds DCP metadata, parsed strictly, errors name field+file."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.record import FORMAT_NAME, FORMAT_VERSION, Extent, decode_record, encode_record
from tests.conftest import (
    load_fails,
    load_target,
    read_record_json,
    save,
    seal_record,
    write_record_json,
)

SOURCE = "/ckpt/step_7/.metadata"
SUM = "xxh3-64id:%016x"


def _metadata() -> tuple[Metadata, dict[MetadataIndex, Extent]]:
    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16, requires_grad=True), torch.Size([4, 6]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
         ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))])
    md = Metadata(state_dict_metadata={"w": w, "step": BytesStorageMetadata()},
                  planner_data={"w": ("w",), "step": ("step",)},
                  storage_meta=StorageMeta(checkpoint_id="/ckpt/step_7", save_id="abc",
                                           modules=["model"]),
                  version="1.0.0")
    extents = {
        MetadataIndex("w", [0, 0]): Extent("__0_0.abc.dcpp", 0, 24, 24, "identity", SUM % 1),
        MetadataIndex("w", [2, 0]): Extent("__1_0.abc.dcpp", 4096, 24, 24, "identity", SUM % 2),
        MetadataIndex("step"): Extent("__0_0.abc.dcpp", 8192, 500, 500, "identity", SUM % 3),
    }
    return md, extents


def _record() -> dict[str, Any]:
    md, extents = _metadata()
    return json.loads(encode_record(md, extents))


def test_encoded_record_decodes_to_the_same_metadata():
    md, extents = _metadata()

    out = decode_record(encode_record(md, extents), SOURCE)

    assert out.state_dict_metadata == md.state_dict_metadata
    assert out.storage_data == extents
    assert out.planner_data == md.planner_data
    assert out.storage_meta == md.storage_meta
    assert out.version == "1.0.0"
    rec = _record()
    assert (rec["format"], rec["version"]) == (FORMAT_NAME, FORMAT_VERSION)


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(rec: dict[str, Any]) -> None:
        obj = rec
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return edit


def _delete(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def edit(rec: dict[str, Any]) -> None:
        obj = rec
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]
    return edit


BAD_RECORDS = {
    # name: (edit, field the message must name)
    "unknown_format": (_set(["format"], "torch_dcp"), "'format'"),
    "missing_format": (_delete(["format"]), "'format'"),
    "future_version": (_set(["version"], 6), "'version'"),
    "version_as_string": (_set(["version"], "1"), "'version'"),
    "version_as_bool": (_set(["version"], True), "'version'"),
    "missing_version": (_delete(["version"]), "'version'"),
    "missing_items": (_delete(["items"]), "'items'"),
    "items_not_object": (_set(["items"], [1, 2]), "'items'"),
    "item_not_object": (_set(["items", "w"], 5), "items['w']"),
    "unknown_kind": (_set(["items", "w", "kind"], "sparse"), "items['w'].kind"),
    "unknown_dtype": (_set(["items", "w", "dtype"], "float128"), "items['w'].dtype"),
    "dtype_not_string": (_set(["items", "w", "dtype"], 7), "items['w'].dtype"),
    "missing_dtype": (_delete(["items", "w", "dtype"]), "items['w'].dtype"),
    "requires_grad_not_bool": (_set(["items", "w", "requires_grad"], "yes"),
                               "items['w'].requires_grad"),
    "negative_size": (_set(["items", "w", "size"], [-4, 6]), "items['w'].size"),
    "size_of_strings": (_set(["items", "w", "size"], ["4", "6"]), "items['w'].size"),
    "missing_chunks": (_delete(["items", "w", "chunks"]), "items['w'].chunks"),
    "chunk_missing_offsets": (_delete(["items", "w", "chunks", 1, "offsets"]),
                              "items['w'].chunks[1].offsets"),
    "chunk_sizes_float": (_set(["items", "w", "chunks", 0, "sizes"], [2.0, 6]),
                          "items['w'].chunks[0].sizes"),
    "chunk_rank_mismatch": (_set(["items", "w", "chunks", 0, "offsets"], [0]),
                            "items['w'].chunks[0]"),
    "chunk_outside_tensor": (_set(["items", "w", "chunks", 1, "offsets"], [3, 0]),
                             "items['w'].chunks[1]"),
    "missing_extents": (_delete(["extents"]), "'extents'"),
    "extents_not_list": (_set(["extents"], {"a": 1}), "'extents'"),
    "extent_not_object": (_set(["extents", 1], "x"), "extents[1]"),
    "extent_missing_offset": (_delete(["extents", 1, "offset"]), "extents[1].offset"),
    "extent_offset_string": (_set(["extents", 1, "offset"], "4096"), "extents[1].offset"),
    "extent_offset_negative": (_set(["extents", 1, "offset"], -1), "extents[1]"),
    "extent_length_float": (_set(["extents", 2, "length"], 500.0), "extents[2].length"),
    "extent_length_bool": (_set(["extents", 2, "length"], True), "extents[2].length"),
    "extent_raw_length_missing": (_delete(["extents", 0, "raw_length"]),
                                  "extents[0].raw_length"),
    "extent_codec_missing": (_delete(["extents", 0, "codec"]), "extents[0].codec"),
    "extent_checksum_number": (_set(["extents", 0, "checksum"], 12), "extents[0].checksum"),
    "extent_unknown_fqn": (_set(["extents", 0, "fqn"], "ghost"), "extents[0].fqn"),
    "extent_chunk_string": (_set(["extents", 0, "chunk"], "0,0"), "extents[0].chunk"),
    "extent_file_parent": (_set(["extents", 0, "file"], "../x"), "extents[0].file"),
    "extent_file_absolute": (_set(["extents", 0, "file"], "/etc/passwd"), "extents[0].file"),
    "extent_file_dotdot_inside": (_set(["extents", 0, "file"], "a/../../x"), "extents[0].file"),
    "extent_file_unnormalized": (_set(["extents", 0, "file"], "./x"), "extents[0].file"),
    "extent_file_empty": (_set(["extents", 0, "file"], ""), "extents[0].file"),
    "extent_file_backslash": (_set(["extents", 0, "file"], "..\\x"), "extents[0].file"),
    "extent_file_nul": (_set(["extents", 0, "file"], "x\x00y"), "extents[0].file"),
    "planner_data_not_object": (_set(["planner_data"], [1]), "'planner_data'"),
    "planner_data_bad_path": (_set(["planner_data", "w"], [{"a": 1}]), "'planner_data'"),
    "storage_meta_not_object": (_set(["storage_meta"], 5), "'storage_meta'"),
    "storage_meta_modules_string": (_set(["storage_meta", "modules"], "model"),
                                    "storage_meta.modules"),
    "storage_meta_save_id_number": (_set(["storage_meta", "save_id"], 3),
                                    "storage_meta.save_id"),
    "dcp_version_number": (_set(["dcp_version"], 1.0), "'dcp_version'"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_malformed_record_is_refused_naming_field_and_file(case):
    edit, field = BAD_RECORDS[case]
    rec = _record()
    edit(rec)

    with pytest.raises(CheckpointFormatError) as info:
        decode_record(seal_record(rec), SOURCE)

    assert SOURCE in str(info.value)
    assert field in str(info.value), str(info.value)


@pytest.mark.parametrize("data", [b"\xff\xfe{", b"{not json", b"[1, 2]", b"null"],
                         ids=["not_utf8", "not_json", "list", "null"])
def test_non_record_bytes_are_refused_naming_the_file(data):
    with pytest.raises(CheckpointFormatError, match="/ckpt/step_7/.metadata"):
        decode_record(data, SOURCE)


def test_unchanged_record_still_parses():
    # guards the table above: each case must fail because of its edit alone
    rec = copy.deepcopy(_record())
    decode_record(seal_record(rec), SOURCE)


def test_record_naming_unknown_version_is_refused_through_dcp_load(tmp_path):
    sd = {"w": torch.arange(6.0)}
    save(sd, tmp_path / "ckpt")
    rec = read_record_json(tmp_path / "ckpt")
    rec["version"] = 99
    write_record_json(tmp_path / "ckpt", rec)

    msg = load_fails(load_target(sd), tmp_path / "ckpt")

    assert "'version'" in msg and str(tmp_path / "ckpt" / ".metadata") in msg


def test_tensor_without_an_extent_is_reported_at_load(tmp_path):
    sd = {"w": torch.arange(6.0), "v": torch.ones(3)}
    save(sd, tmp_path / "ckpt")
    rec = read_record_json(tmp_path / "ckpt")
    rec["extents"] = [e for e in rec["extents"] if e["fqn"] != "v"]
    write_record_json(tmp_path / "ckpt", rec)

    msg = load_fails(load_target(sd), tmp_path / "ckpt")

    assert ".metadata" in msg and "'v'" in msg and "no extent" in msg


@pytest.mark.parametrize("key, problem", [("w\x00x", "NUL"), ("w\ud800", "surrogate")])
@pytest.mark.parametrize("items", [2, 1200])  # the row form, and the columnar one
def test_a_key_that_is_not_storable_text_is_refused_naming_it(tmp_path, key, problem, items):
    from tests.conftest import save

    state = {f"ok.{i}": torch.ones(2) for i in range(items - 1)} | {key: torch.ones(2)}
    with pytest.raises(BaseException, match=problem) as info:  # DCP's CheckpointException
        save(state, tmp_path / "c")
    assert repr(key) in str(info.value) and "UTF-8" in str(info.value)
    assert not (tmp_path / "c" / ".metadata").exists()
