"""The commit record ``.metadata``: UTF-8 JSON, parsed strictly, never unpickled.

It carries DCP's ``Metadata`` (tensor properties, chunks, bytes entries, planner data) and one
extent per stored item. A checkpoint exists iff its record exists.

Version 2 (written since dcp_plus 0.2) binds each extent's checksum to the extent's identity
(:func:`~dcp_plus.format.extent.extent_identity`) and seals the record: its last field is
``"record_checksum"``, the xxh3-64 of the record's bytes without that field. Version 1
records (neither) are still read. Either way the whole record is validated before any data
is read (:mod:`dcp_plus.format.record_checks`).
"""

from __future__ import annotations

import contextlib
import gc
import posixpath
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict
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

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.checksum import ALGORITHM, BOUND_ALGORITHM, checksum_bytes
from dcp_plus.format.codecs import known_codec
from dcp_plus.format.extent import Extent, extent_identity
from dcp_plus.format.layout import MAX_RECORD_BYTES, is_data_file
from dcp_plus.format.record_checks import (
    INT64_MAX,
    MAX_DIMS,
    STORED_DTYPES,
    check_extents_match_items,
    check_no_aliasing,
    check_tiling,
)
from dcp_plus.format.strict_json import check_text, loads_strict

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MAX_RECORD_BYTES", "RECORD_NAME", "Extent",
           "decode_extent_table", "decode_record", "dtype_name", "encode_extent_table",
           "encode_record", "extent_identity", "seal"]

FORMAT_NAME = "dcp_plus"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
RECORD_NAME = ".metadata"
MAX_NAME_CHARS = 1 << 16

_TRAILER = re.compile(rb',"record_checksum":"([^"]{0,64})"\}\s*\Z')
_CHECKSUM = {1: re.compile(rf"^{ALGORITHM}:[0-9a-f]{{16}}$"),
             2: re.compile(rf"^{BOUND_ALGORITHM}:[0-9a-f]{{16}}$")}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a record's millions of acyclic objects are built:
    the collections it would trigger take half of a 100,000-tensor decode's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def seal(body: bytes) -> bytes:
    """``body`` (a JSON object's bytes) with ``"record_checksum"`` appended as its last field."""
    if not body.endswith(b"}"):
        raise ValueError("a record is a JSON object")
    return b"%s,\"record_checksum\":\"%s\"}" % (body[:-1], checksum_bytes(body).encode())


def encode_record(metadata: Metadata, extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """Serialize DCP metadata and the extent table to the sealed version-2 record's bytes."""
    with _gc_paused():
        return _encode_record(metadata, extents)


def _encode_record(metadata: Metadata, extents: Mapping[MetadataIndex, Extent]) -> bytes:
    import json

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
        "extents": encode_extents(extents),
    }
    return seal(json.dumps(record, separators=(",", ":")).encode())


def encode_extents(extents: Mapping[MetadataIndex, Extent]) -> list[dict[str, Any]]:
    """The JSON rows of an extent table (the record's ``extents`` field)."""
    rows = []
    for idx, ext in extents.items():
        row = {"fqn": idx.fqn, "chunk": None if idx.offset is None else list(idx.offset),
               **asdict(ext)}
        if ext.value is None:
            del row["value"]
        rows.append(row)
    return rows


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
        if isinstance(value, int) and not isinstance(value, bool) and not (
                -INT64_MAX - 1 <= value <= INT64_MAX):
            raise self.fail(field, "integer out of the int64 range")
        if isinstance(value, str):
            self.text(value, field)
        return value

    def text(self, value: str, field: str) -> str:
        problem = check_text(value)
        if problem is None and len(value) > MAX_NAME_CHARS:
            problem = f"is {len(value)} characters long"
        if problem is not None:
            raise self.fail(field, f"the string {value[:80]!r} {problem}")
        return value

    def ints(self, obj: Any, key: str, where: str) -> list[int]:
        values = self.get(obj, key, list, where)
        if len(values) > MAX_DIMS or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX
                for v in values):
            raise self.fail(f"{where}.{key}", f"expected a list of at most {MAX_DIMS} "
                                              "non-negative int64 integers")
        return values

    def relative_path(self, path: str, field: str) -> str:
        if not path or "\\" in path or "\x00" in path:
            raise self.fail(field, f"invalid path {path!r}")
        norm = posixpath.normpath(path)
        if posixpath.isabs(path) or norm == ".." or norm.startswith("../") or norm != path:
            raise self.fail(field, f"path {path!r} escapes the checkpoint directory")
        if any(part.startswith(".") for part in path.split("/")):
            raise self.fail(field, f"path {path!r}: data files are never hidden files")
        return path


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
    with _gc_paused():
        return _decode_record(data, source)


def _decode_record(data: bytes, source: str) -> Metadata:
    if len(data) > MAX_RECORD_BYTES:
        raise CheckpointFormatError(f"{source}: {len(data)} bytes, larger than any commit "
                                    f"record ({MAX_RECORD_BYTES})")
    p = _Parser(source)
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

    sd_md = {p.text(fqn, f"items[{fqn[:80]!r}]"): _decode_item(p, fqn, item)
             for fqn, item in p.get(root, "items", dict, "").items()}
    storage, rows = _decode_extents(p, p.get(root, "extents", list, ""), sd_md, version)
    check_extents_match_items(sd_md, storage, rows, p.fail)
    check_no_aliasing(storage, p.fail)

    planner_data = root.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
            isinstance(v, list) and all(isinstance(x, (str, int)) and not isinstance(x, bool)
                                        and (not isinstance(x, str) or check_text(x) is None)
                                        for x in v)
            for v in planner_data.values()
        ):
            raise p.fail("planner_data", "expected an object of key paths")
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    return Metadata(state_dict_metadata=sd_md, planner_data=planner_data,
                    storage_data=storage, storage_meta=_decode_storage_meta(p, root),
                    version=_decode_dcp_version(p, root))


def _ints_ok(values: Any, ndim: int) -> bool:
    return (type(values) is list and len(values) == ndim
            and all(type(v) is int and 0 <= v <= INT64_MAX for v in values))


def _fast_tensor(p: _Parser, fqn: str, item: Any) -> TensorStorageMetadata | None:
    """The common well-formed tensor item, checked with the fewest operations; None for
    anything else, which :func:`_decode_item` then parses field by field (and names the
    field that is wrong). Chunks that do not tile the tensor are refused here."""
    if type(item) is not dict or item.get("kind") != "tensor":
        return None
    dname, grad, size, chunks = (item.get("dtype"), item.get("requires_grad"), item.get("size"),
                                 item.get("chunks"))
    if type(dname) is not str or dname not in STORED_DTYPES or type(grad) is not bool:
        return None
    if type(size) is not list or len(size) > MAX_DIMS or not _ints_ok(size, len(size)):
        return None
    dtype = STORED_DTYPES[dname]
    if type(chunks) is not list or _nbytes(size, dtype) > INT64_MAX:
        return None
    parsed = []
    for c in chunks:
        if type(c) is not dict:
            return None
        offsets: Any = c.get("offsets")
        sizes: Any = c.get("sizes")
        if not (_ints_ok(offsets, len(size)) and _ints_ok(sizes, len(size))):
            return None
        if (sizes != size or any(offsets)) and any(
                o + n > t for o, n, t in zip(offsets, sizes, size, strict=True)):
            return None
        parsed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    whole = len(parsed) == 1 and not any(chunks[0]["offsets"]) and chunks[0]["sizes"] == size
    if not whole:
        check_tiling(torch.Size(size), parsed, f"items[{fqn!r}].chunks", p.fail)
    return TensorStorageMetadata(TensorProperties(dtype=dtype, requires_grad=grad),
                                 torch.Size(size), parsed)


def _decode_item(p: _Parser, fqn: str, item: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    fast = _fast_tensor(p, fqn, item)
    if fast is not None:
        return fast
    where = f"items[{fqn!r}]"
    kind = p.get(item, "kind", str, where)
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise p.fail(f"{where}.kind", f"unknown kind {kind!r}")
    dname = p.get(item, "dtype", str, where)
    if dname not in STORED_DTYPES:
        raise p.fail(f"{where}.dtype", f"unknown dtype {dname!r} (dcp_plus stores "
                                       f"{', '.join(STORED_DTYPES)})")
    dtype = STORED_DTYPES[dname]
    props = TensorProperties(dtype=dtype, requires_grad=p.get(item, "requires_grad", bool, where))
    size = p.ints(item, "size", where)
    if _nbytes(size, dtype) > INT64_MAX:
        raise p.fail(f"{where}.size", f"a tensor of {size} {dname} is larger than 2^63 bytes")
    chunks = []
    for i, c in enumerate(p.get(item, "chunks", list, where)):
        cw = f"{where}.chunks[{i}]"
        offsets, sizes = p.ints(c, "offsets", cw), p.ints(c, "sizes", cw)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            raise p.fail(cw, f"chunk at {offsets} of size {sizes} does not fit in "
                             f"a tensor of size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    check_tiling(torch.Size(size), chunks, f"{where}.chunks", p.fail)
    return TensorStorageMetadata(props, torch.Size(size), chunks)


def _nbytes(size: list[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in size:
        n *= s
    return n


def _decode_extents(p: _Parser, rows: list[Any],
                    items: Mapping[str, TensorStorageMetadata | BytesStorageMetadata] | None,
                    version: int, field: str = "extents"
                    ) -> tuple[dict[MetadataIndex, Extent], dict[MetadataIndex, int]]:
    """Extent rows -> ``{index: Extent}`` and each index's row; with ``items``, every row
    must name one of them."""
    storage: dict[MetadataIndex, Extent] = {}
    where_of: dict[MetadataIndex, int] = {}
    checksum = _CHECKSUM[version]
    for i, entry in enumerate(rows):
        fast = _fast_row(entry, checksum)
        if fast is not None and (items is None or fast[0].fqn in items) and \
                fast[0] not in storage:
            storage[fast[0]] = fast[1]
            where_of[fast[0]] = i
            continue
        where = f"{field}[{i}]"
        fqn = p.get(entry, "fqn", str, where)
        if items is not None and fqn not in items:
            raise p.fail(f"{where}.fqn", f"{fqn!r} is not an item of this checkpoint")
        chunk = p.get(entry, "chunk", (list, type(None)), where)
        if chunk is not None:
            chunk = p.ints(entry, "chunk", where)
        value = p.get(entry, "value", str, where) if "value" in entry else None
        ext = Extent(
            file=p.relative_path(p.get(entry, "file", str, where), f"{where}.file"),
            offset=p.get(entry, "offset", int, where),
            length=p.get(entry, "length", int, where),
            raw_length=p.get(entry, "raw_length", int, where),
            codec=p.get(entry, "codec", str, where),
            checksum=p.get(entry, "checksum", str, where),
            value=value,
        )
        if min(ext.offset, ext.length, ext.raw_length) < 0:
            raise p.fail(where, "negative offset or length")
        if ext.offset + ext.length > INT64_MAX:
            raise p.fail(where, "extent ends beyond the int64 range")
        if not known_codec(ext.codec):
            raise p.fail(f"{where}.codec", f"unknown codec {ext.codec!r}")
        if not _CHECKSUM[version].match(ext.checksum):
            raise p.fail(f"{where}.checksum", f"{ext.checksum[:80]!r} is not a version-{version}"
                                              " extent checksum")
        index = MetadataIndex(fqn, chunk)
        if index in storage:
            raise p.fail(where, f"a second extent for the same item as extents[{where_of[index]}]")
        storage[index] = ext
        where_of[index] = i
    return storage, where_of


def _fast_row(entry: Any, checksum: re.Pattern[str]) -> tuple[MetadataIndex, Extent] | None:
    """The common well-formed extent row (one of our data files, a known codec), checked
    with the fewest operations; None for anything else, which the field-by-field parse then
    refuses or accepts with a precise message."""
    if type(entry) is not dict:
        return None
    try:
        fqn, chunk, file, offset, length, raw, codec, cs = (
            entry["fqn"], entry["chunk"], entry["file"], entry["offset"], entry["length"],
            entry["raw_length"], entry["codec"], entry["checksum"])
    except KeyError:
        return None
    value = entry.get("value")
    if not (type(fqn) is str and type(offset) is int and type(length) is int
            and type(raw) is int and type(codec) is str and type(cs) is str
            and type(file) is str and (value is None or type(value) is str)):
        return None
    if not (offset >= 0 and length >= 0 and 0 <= raw <= INT64_MAX
            and offset + length <= INT64_MAX and len(fqn) <= MAX_NAME_CHARS):
        return None
    if chunk is not None and (type(chunk) is not list or len(chunk) > MAX_DIMS
                              or not _ints_ok(chunk, len(chunk))):
        return None
    if check_text(fqn) is not None or (value is not None and check_text(value) is not None):
        return None
    if not (is_data_file(file) and known_codec(codec) and checksum.match(cs)):
        return None
    return MetadataIndex(fqn, chunk), Extent(file, offset, length, raw, codec, cs, value)


def _decode_storage_meta(p: _Parser, root: dict[str, Any]) -> StorageMeta:
    sm = root.get("storage_meta")
    if sm is None:
        return StorageMeta()
    if not isinstance(sm, dict):
        raise p.fail("storage_meta", f"expected an object or null, got {type(sm).__name__}")
    modules = sm.get("modules", [])
    if not isinstance(modules, list) or not all(
            isinstance(m, str) and check_text(m) is None for m in modules):
        raise p.fail("storage_meta.modules", "expected a list of strings")
    return StorageMeta(
        checkpoint_id=p.get(sm, "checkpoint_id", (str, type(None)), "storage_meta")
        if "checkpoint_id" in sm else None,
        save_id=p.get(sm, "save_id", (str, type(None)), "storage_meta")
        if "save_id" in sm else None,
        modules=modules)


def _decode_dcp_version(p: _Parser, root: dict[str, Any]) -> str | None:
    dcp_version = root.get("dcp_version")
    if dcp_version is not None and not isinstance(dcp_version, str):
        raise p.fail("dcp_version", f"expected a string or null, got {type(dcp_version).__name__}")
    return None if dcp_version is None else p.text(dcp_version, "dcp_version")


EXTENT_TABLE_FORMAT = "dcp_plus-extents"


def encode_extent_table(extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """One rank's extents, exchanged through storage instead of the process group."""
    import json

    return json.dumps({"format": EXTENT_TABLE_FORMAT, "version": FORMAT_VERSION,
                       "extents": encode_extents(extents)}, separators=(",", ":")).encode()


def decode_extent_table(data: bytes, source: str) -> dict[MetadataIndex, Extent]:
    """Parse :func:`encode_extent_table` output strictly (errors name field and ``source``)."""
    p = _Parser(source)
    root = loads_strict(data, source, "extent table")
    if p.get(root, "format", str, "") != EXTENT_TABLE_FORMAT:
        raise p.fail("format", f"expected {EXTENT_TABLE_FORMAT!r}")
    if p.get(root, "version", int, "") != FORMAT_VERSION:
        raise p.fail("version", f"unsupported version; expected {FORMAT_VERSION}")
    return _decode_extents(p, p.get(root, "extents", list, ""), None, FORMAT_VERSION)[0]
