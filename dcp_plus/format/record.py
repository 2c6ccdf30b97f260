"""The commit record ``.metadata``: UTF-8 JSON, parsed strictly, never unpickled.

It carries DCP's ``Metadata`` (tensor properties, chunks, bytes entries, planner data) and one
extent per stored item. A checkpoint exists iff its record exists.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

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

FORMAT_NAME = "dcp_plus"
FORMAT_VERSION = 1
RECORD_NAME = ".metadata"

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}


@dataclass(frozen=True)
class Extent:
    """Where one stored item lives: ``length`` stored bytes at ``offset`` of ``file``."""

    file: str
    offset: int
    length: int
    raw_length: int
    codec: str
    checksum: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_record(metadata: Metadata, extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """Serialize DCP metadata and the extent table to the record's JSON bytes."""
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
    table = encode_extents(extents)
    sm = metadata.storage_meta
    record = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dcp_version": metadata.version,
        "storage_meta": None
        if sm is None
        else {"checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
              "save_id": sm.save_id, "modules": list(sm.modules)},
        "planner_data": _encode_planner_data(metadata.planner_data),
        "items": items,
        "extents": table,
    }
    return json.dumps(record, separators=(",", ":")).encode()


def encode_extents(extents: Mapping[MetadataIndex, Extent]) -> list[dict[str, Any]]:
    """The JSON rows of an extent table (the record's ``extents`` field)."""
    return [
        {"fqn": idx.fqn, "chunk": None if idx.offset is None else list(idx.offset), **asdict(ext)}
        for idx, ext in extents.items()
    ]


def _encode_planner_data(planner_data: Any) -> Any:
    if planner_data is None:
        return None
    if not isinstance(planner_data, Mapping):
        raise CheckpointFormatError(
            f"planner_data of type {type(planner_data).__name__} cannot be stored as JSON; "
            "dcp_plus records only DefaultSavePlanner's flatten mapping"
        )
    return {k: list(v) for k, v in planner_data.items()}


class _Parser:
    """Field access that names the field and the file in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.source}: field {field!r}: {problem}")

    def get(self, obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        field = f"{where}.{key}" if where else key
        if not isinstance(obj, dict):
            raise self.fail(where or "<root>", "expected a JSON object")
        if key not in obj:
            raise self.fail(field, "missing")
        value = obj[key]
        # bool is an int subclass; never accept it where a number is meant
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.fail(field, f"expected {kind}, got bool")
        if not isinstance(value, kind):
            raise self.fail(field, f"expected {getattr(kind, '__name__', kind)}, got "
                                   f"{type(value).__name__}")
        return value

    def ints(self, obj: Any, key: str, where: str) -> list[int]:
        values = self.get(obj, key, list, where)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.fail(f"{where}.{key}", "expected a list of non-negative integers")
        return values

    def relative_path(self, path: str, field: str) -> str:
        if not path or "\\" in path or "\x00" in path:
            raise self.fail(field, f"invalid path {path!r}")
        norm = posixpath.normpath(path)
        if posixpath.isabs(path) or norm == ".." or norm.startswith("../") or norm != path:
            raise self.fail(field, f"path {path!r} escapes the checkpoint directory")
        return path


def decode_record(data: bytes, source: str) -> Metadata:
    """Parse record bytes into DCP ``Metadata``; ``storage_data`` maps index -> ``Extent``.

    Raises:
        CheckpointFormatError: naming the field and ``source`` for any deviation.
    """
    p = _Parser(source)
    try:
        root = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(
            f"{source}: not a dcp_plus commit record (not UTF-8 JSON: {e})"
        ) from None
    if not isinstance(root, dict):
        raise p.fail("<root>", "expected a JSON object")
    fmt = p.get(root, "format", str, "")
    if fmt != FORMAT_NAME:
        raise p.fail("format", f"unknown format {fmt!r}, expected {FORMAT_NAME!r}")
    version = p.get(root, "version", int, "")
    if version != FORMAT_VERSION:
        raise p.fail("version", f"unsupported version {version}; this reader reads "
                                f"version {FORMAT_VERSION} (upgrade dcp_plus)")

    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, item in p.get(root, "items", dict, "").items():
        where = f"items[{fqn!r}]"
        kind = p.get(item, "kind", str, where)
        if kind == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
        elif kind == "tensor":
            dname = p.get(item, "dtype", str, where)
            if dname not in _DTYPES:
                raise p.fail(f"{where}.dtype", f"unknown dtype {dname!r}")
            props = TensorProperties(dtype=_DTYPES[dname],
                                     requires_grad=p.get(item, "requires_grad", bool, where))
            size = p.ints(item, "size", where)
            chunks = []
            for i, c in enumerate(p.get(item, "chunks", list, where)):
                cw = f"{where}.chunks[{i}]"
                offsets, sizes = p.ints(c, "offsets", cw), p.ints(c, "sizes", cw)
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                        o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
                    raise p.fail(cw, f"chunk at {offsets} of size {sizes} does not fit in "
                                     f"a tensor of size {size}")
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                   sizes=torch.Size(sizes)))
            sd_md[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)
        else:
            raise p.fail(f"{where}.kind", f"unknown kind {kind!r}")

    storage = _decode_extents(p, p.get(root, "extents", list, ""), set(sd_md))

    planner_data = root.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
            isinstance(v, list) and all(isinstance(x, (str, int)) for x in v)
            for v in planner_data.values()
        ):
            raise p.fail("planner_data", "expected an object of key paths")
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    sm = root.get("storage_meta")
    storage_meta = StorageMeta()
    if sm is not None:
        if not isinstance(sm, dict):
            raise p.fail("storage_meta", f"expected an object or null, got {type(sm).__name__}")
        modules = sm.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise p.fail("storage_meta.modules", "expected a list of strings")
        storage_meta = StorageMeta(
            checkpoint_id=p.get(sm, "checkpoint_id", (str, type(None)), "storage_meta")
            if "checkpoint_id" in sm else None,
            save_id=p.get(sm, "save_id", (str, type(None)), "storage_meta")
            if "save_id" in sm else None,
            modules=modules)
    dcp_version = root.get("dcp_version")
    if dcp_version is not None and not isinstance(dcp_version, str):
        raise p.fail("dcp_version", f"expected a string or null, got {type(dcp_version).__name__}")
    return Metadata(state_dict_metadata=sd_md, planner_data=planner_data,
                    storage_data=storage, storage_meta=storage_meta, version=dcp_version)


def _decode_extents(p: _Parser, rows: list[Any], known: set[str] | None,
                    field: str = "extents") -> dict[MetadataIndex, Extent]:
    storage: dict[MetadataIndex, Extent] = {}
    for i, entry in enumerate(rows):
        where = f"{field}[{i}]"
        fqn = p.get(entry, "fqn", str, where)
        if known is not None and fqn not in known:
            raise p.fail(f"{where}.fqn", f"{fqn!r} is not an item of this checkpoint")
        chunk = p.get(entry, "chunk", (list, type(None)), where)
        if chunk is not None:
            chunk = p.ints(entry, "chunk", where)
        ext = Extent(
            file=p.relative_path(p.get(entry, "file", str, where), f"{where}.file"),
            offset=p.get(entry, "offset", int, where),
            length=p.get(entry, "length", int, where),
            raw_length=p.get(entry, "raw_length", int, where),
            codec=p.get(entry, "codec", str, where),
            checksum=p.get(entry, "checksum", str, where),
        )
        if min(ext.offset, ext.length, ext.raw_length) < 0:
            raise p.fail(where, "negative offset or length")
        storage[MetadataIndex(fqn, chunk)] = ext
    return storage


EXTENT_TABLE_FORMAT = "dcp_plus-extents"


def encode_extent_table(extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """One rank's extents, exchanged through storage instead of the process group."""
    return json.dumps({"format": EXTENT_TABLE_FORMAT, "version": FORMAT_VERSION,
                       "extents": encode_extents(extents)}, separators=(",", ":")).encode()


def decode_extent_table(data: bytes, source: str) -> dict[MetadataIndex, Extent]:
    """Parse :func:`encode_extent_table` output strictly (errors name field and ``source``)."""
    p = _Parser(source)
    try:
        root = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{source}: not an extent table ({e})") from None
    if p.get(root, "format", str, "") != EXTENT_TABLE_FORMAT:
        raise p.fail("format", f"expected {EXTENT_TABLE_FORMAT!r}")
    if p.get(root, "version", int, "") != FORMAT_VERSION:
        raise p.fail("version", f"unsupported version; expected {FORMAT_VERSION}")
    return _decode_extents(p, p.get(root, "extents", list, ""), None)
