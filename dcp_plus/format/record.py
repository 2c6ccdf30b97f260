"""The commit record ``.metadata``: UTF-8 JSON, parsed strictly, never unpickled.

It carries DCP's ``Metadata`` (tensor properties, chunks, bytes entries, planner data) and one
extent per stored item. A checkpoint exists iff its record exists.

Version 2 (written since dcp_plus 0.2) binds each extent's checksum to the extent's identity
(:func:`~dcp_plus.format.extent.extent_identity`) and seals the record: its last field is
``"record_checksum"``, the xxh3-64 of the record's bytes without that field. Version 1
records (neither) are still read. Version 3 is version 2 whose extents may name a key
prefix (``"prefix"``: :mod:`dcp_plus.format.key_prefix`); a record is written as version 3
only when one does, so that older readers refuse it clearly. Version 4 is columnar
(:mod:`dcp_plus.format.record_columns`), written for records of :data:`COLUMNAR_MIN_ITEMS`
items or more: a record of 100,000 tensors is 10 MB instead of 34 and decodes ~4x faster.
Version 5 is an incremental checkpoint's record, in either form (``"layout"``: ``"rows"`` or
``"columns"``): its extents may be stored as parts and may reference sibling checkpoints
(:mod:`dcp_plus.format.parts`), and ``"bases"`` lists every checkpoint it references, so
that retention keeps them (derived from records alone).
Either way the whole record is validated before any data is read
(:mod:`dcp_plus.format.record_checks`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcp_plus._gc import gc_paused
from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.columns_encode import encode_columns
from dcp_plus.format.extent import Extent, extent_identity
from dcp_plus.format.extent_columns import decode_extent_table, encode_extent_table
from dcp_plus.format.extent_set import bases_of
from dcp_plus.format.layout import MAX_RECORD_BYTES
from dcp_plus.format.parts import part_json, sibling_problem
from dcp_plus.format.planner_data import decode_planner_data, encode_planner_data, planner_paths
from dcp_plus.format.record_checks import (
    check_extents_match_items,
    check_no_aliasing,
    check_prefixes,
    check_references,
)
from dcp_plus.format.record_columns import decode_columns
from dcp_plus.format.record_fields import (
    FieldParser,
    decode_dcp_version,
    decode_extents,
    decode_item,
    decode_storage_meta,
)
from dcp_plus.format.record_memo import encode_columnar, record_memo
from dcp_plus.format.strict_json import loads_strict

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MAX_RECORD_BYTES", "RECORD_NAME", "Extent",
           "decode_extent_table", "decode_record", "dtype_name", "encode_extent_table",
           "encode_record", "extent_identity", "seal"]

FORMAT_NAME = "dcp_plus"
FORMAT_VERSION = 2
PREFIXED_VERSION = 3
"""The version of a record whose data objects lie under key prefixes."""
COLUMNAR_VERSION = 4
"""The version of a columnar record (:mod:`dcp_plus.format.record_columns`)."""
INCREMENTAL_VERSION = 5
"""The version of a record whose extents have parts or reference other checkpoints."""
COLUMNAR_MIN_ITEMS = 1000
"""Records of this many items or more are written columnar: smaller ones keep the row form
that every earlier reader reads (and that is easier to read by eye)."""
READABLE_VERSIONS = (1, 2, 3, 4, 5)
RECORD_NAME = ".metadata"

_TRAILER = re.compile(rb',"record_checksum":"([^"]{0,64})"\}\s*\Z')


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def seal(body: bytes) -> bytes:
    """``body`` (a JSON object's bytes) with ``"record_checksum"`` appended as its last field."""
    if not body.endswith(b"}"):
        raise ValueError("a record is a JSON object")
    return b"%s,\"record_checksum\":\"%s\"}" % (body[:-1], checksum_bytes(body).encode())


def encode_record(metadata: Metadata, extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """Serialize DCP metadata and the extent table to the sealed record's bytes (version 2;
    3 when an extent has a key prefix)."""
    with gc_paused():
        return _encode_record(metadata, extents)


def _encode_record(metadata: Metadata, extents: Mapping[MetadataIndex, Extent]) -> bytes:
    import json

    columnar = len(metadata.state_dict_metadata) >= COLUMNAR_MIN_ITEMS
    sm = metadata.storage_meta
    bases = bases_of(extents)
    memo = record_memo(metadata) if columnar else None
    record: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": INCREMENTAL_VERSION if bases is not None else COLUMNAR_VERSION if columnar
        else PREFIXED_VERSION if any(e.prefix for e in extents.values()) else FORMAT_VERSION,
        "dcp_version": metadata.version,
        "storage_meta": None
        if sm is None
        else {"checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
              "save_id": sm.save_id, "modules": list(sm.modules)},
        "planner_data": None if memo is not None  # the memo's
        else encode_planner_data(metadata.planner_data),
    }
    if bases is not None:
        record["layout"] = "columns" if columnar else "rows"
        record["bases"] = bases
    if memo is not None:
        return seal(encode_columnar(record, metadata, extents, dtype_name, memo))
    if columnar:
        record.update(encode_columns(metadata, extents, dtype_name))
        paths = planner_paths(metadata.planner_data, record["items"]["fqn"])
        if paths is not None:
            record["planner_data"], record["planner_paths"] = None, paths
    else:
        record["items"] = _encode_items(metadata)
        record["extents"] = encode_extents(extents)
    return seal(json.dumps(record, separators=(",", ":")).encode())


def _encode_items(metadata: Metadata) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            items[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                "requires_grad": bool(md.properties.requires_grad),
                "size": list(md.size),
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks
                ],
            }
        elif isinstance(md, BytesStorageMetadata):
            items[fqn] = {"kind": "bytes"}
        else:
            raise CheckpointFormatError(f"cannot record {fqn!r}: unknown metadata {type(md)}")
    return items


def encode_extents(extents: Mapping[MetadataIndex, Extent]) -> list[dict[str, Any]]:
    """The JSON rows of an extent table (the record's ``extents`` field)."""
    rows = []
    for idx, ext in extents.items():
        row = {"fqn": idx.fqn, "chunk": None if idx.offset is None else list(idx.offset),
               **ext._asdict()}
        if ext.value is None:
            del row["value"]
        if ext.prefix is None:
            del row["prefix"]
        if ext.base is None:
            del row["base"]
        if ext.parts is None:
            del row["parts"]
        else:
            row["parts"] = [part_json(p) for p in ext.parts]
        rows.append(row)
    return rows


def _unseal(data: bytes, source: str) -> bool:
    """Check the record checksum if the record has one; whether it has."""
    m = _TRAILER.search(data)
    if m is None:
        return False
    body = data[:m.start()] + b"}"
    if checksum_bytes(body).encode() != m.group(1):
        raise CorruptCheckpointError(
            f"{source}: the commit record does not match its record_checksum: it was "
            "damaged or edited after it was written, so none of it is trusted")
    return True


def decode_record(data: bytes, source: str) -> Metadata:
    """Parse and validate record bytes into DCP ``Metadata``; ``storage_data`` maps index ->
    ``Extent``. Nothing is read from the data files.

    Raises:
        CheckpointFormatError: naming the field and ``source`` for any deviation.
        CorruptCheckpointError: a version-2 record that does not match its checksum.
    """
    with gc_paused():
        return _decode_record(data, source)


def _decode_record(data: bytes, source: str) -> Metadata:
    if len(data) > MAX_RECORD_BYTES:
        raise CheckpointFormatError(f"{source}: {len(data)} bytes, larger than any commit "
                                    f"record ({MAX_RECORD_BYTES})")
    p = FieldParser(source)
    sealed = _unseal(data, source)
    root = loads_strict(data, source, "dcp_plus commit record")
    if not isinstance(root, dict):
        raise p.fail("<root>", "expected a JSON object")
    fmt = p.get(root, "format", str, "")
    if fmt != FORMAT_NAME:
        raise p.fail("format", f"unknown format {fmt!r}, expected {FORMAT_NAME!r}")
    version = p.get(root, "version", int, "")
    if version not in READABLE_VERSIONS:
        raise p.fail("version", f"unsupported version {version}; this reader reads versions "
                                f"{', '.join(map(str, READABLE_VERSIONS))} (upgrade dcp_plus)")
    if (version >= 2) != sealed or (not sealed and "record_checksum" in root):
        raise p.fail("record_checksum", "a version-2 record ends with its record_checksum"
                     if version >= 2 else "version-1 records have none")

    bases = _bases(p, root) if version == INCREMENTAL_VERSION else None
    columnar = version == COLUMNAR_VERSION or (bases is not None and _columnar(p, root))
    if columnar:
        sd_md, storage, rows = decode_columns(p, root)
    else:
        sd_md = {p.text(fqn, f"items[{fqn[:80]!r}]"): decode_item(p, fqn, item)
                 for fqn, item in p.get(root, "items", dict, "").items()}
        storage, rows = decode_extents(p, p.get(root, "extents", list, ""), sd_md, version)
        check_extents_match_items(sd_md, storage, rows, p.fail)
        check_no_aliasing(storage, p.fail)
    check_prefixes(storage, rows, version >= PREFIXED_VERSION, p.fail)
    check_references(storage, rows, bases, p.fail)
    planner_data = decode_planner_data(p, root, list(sd_md) if columnar else None)
    return Metadata(state_dict_metadata=sd_md, planner_data=planner_data,
                    storage_data=storage, storage_meta=decode_storage_meta(p, root),
                    version=decode_dcp_version(p, root))


def record_bases(data: bytes, source: str) -> list[str]:
    """The checkpoints beside this one that a commit record references (its ``bases``; none
    before version 5), read without decoding the rest, the seal checked first.

    Raises:
        CheckpointFormatError, CorruptCheckpointError: the record is damaged (its references
            are then unknown).
    """
    if data[:1] != b"{":
        return []  # a stock DCP pickle references nothing
    if len(data) > MAX_RECORD_BYTES:
        raise CheckpointFormatError(f"{source}: {len(data)} bytes, larger than any record")
    _unseal(data, source)
    root = loads_strict(data, source, "dcp_plus commit record")
    p = FieldParser(source)
    if not isinstance(root, dict) or p.get(root, "version", int, "") != INCREMENTAL_VERSION:
        return []
    return _bases(p, root)


def _columnar(p: FieldParser, root: dict[str, Any]) -> bool:
    layout = p.get(root, "layout", str, "")
    if layout not in ("rows", "columns"):
        raise p.fail("layout", f"expected 'rows' or 'columns', got {layout[:80]!r}")
    return layout == "columns"


def _bases(p: FieldParser, root: dict[str, Any]) -> list[str]:
    """A version-5 record's ``bases``: sibling checkpoint names, each listed once."""
    bases = p.get(root, "bases", list, "")
    for i, name in enumerate(bases):
        problem = sibling_problem(name)
        if problem is not None:
            raise p.fail(f"bases[{i}]", problem)
    if len(set(bases)) != len(bases):
        raise p.fail("bases", "a checkpoint is listed twice")
    return bases
