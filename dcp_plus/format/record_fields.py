"""The commit record's fields, parsed strictly: every error names the field and the file.

:func:`~dcp_plus.format.record.decode_record` drives these; the common well-formed tensor
item and extent row take fast paths, anything else is parsed field by field.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.checksum import ALGORITHM, BOUND_ALGORITHM
from dcp_plus.format.codecs import known_codec
from dcp_plus.format.extent import Extent
from dcp_plus.format.key_prefix import prefix_problem
from dcp_plus.format.layout import is_data_file
from dcp_plus.format.parts import CHUNKED, parse_parts, sibling_problem
from dcp_plus.format.record_checks import INT64_MAX, MAX_DIMS, STORED_DTYPES, check_tiling
from dcp_plus.format.strict_json import check_text

MAX_NAME_CHARS = 1 << 16
_CHECKSUM = {1: re.compile(rf"^{ALGORITHM}:[0-9a-f]{{16}}$"),
             2: re.compile(rf"^{BOUND_ALGORITHM}:[0-9a-f]{{16}}$")}
_CHECKSUM[3] = _CHECKSUM[5] = _CHECKSUM[2]


class FieldParser:
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



def _ints_ok(values: Any, ndim: int) -> bool:
    return (type(values) is list and len(values) == ndim
            and all(type(v) is int and 0 <= v <= INT64_MAX for v in values))


def _fast_tensor(p: FieldParser, fqn: str, item: Any) -> TensorStorageMetadata | None:
    """The common well-formed tensor item, checked with the fewest operations; None for
    anything else, which :func:`decode_item` then parses field by field (and names the
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


def decode_item(p: FieldParser, fqn: str, item: Any) -> TensorStorageMetadata | BytesStorageMetadata:
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


def decode_extents(p: FieldParser, rows: list[Any],
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
        prefix = p.get(entry, "prefix", str, where) if "prefix" in entry else None
        if prefix is not None and prefix_problem(prefix) is not None:
            raise p.fail(f"{where}.prefix", f"{prefix_problem(prefix)}: it could point "
                                            "outside the checkpoint")
        base = p.get(entry, "base", str, where) if "base" in entry else None
        if base is not None and sibling_problem(base) is not None:
            raise p.fail(f"{where}.base", str(sibling_problem(base)))
        parts = parse_parts(entry["parts"], p.fail, f"{where}.parts", p.relative_path) \
            if "parts" in entry else None
        ext = Extent(
            file=p.relative_path(p.get(entry, "file", str, where), f"{where}.file"),
            offset=p.get(entry, "offset", int, where),
            length=p.get(entry, "length", int, where),
            raw_length=p.get(entry, "raw_length", int, where),
            codec=p.get(entry, "codec", str, where),
            checksum=p.get(entry, "checksum", str, where),
            value=value,
            prefix=prefix,
            base=base,
            parts=parts,
        )
        if min(ext.offset, ext.length, ext.raw_length) < 0:
            raise p.fail(where, "negative offset or length")
        if ext.offset + ext.length > INT64_MAX:
            raise p.fail(where, "extent ends beyond the int64 range")
        if not known_codec(ext.codec) and ext.codec != CHUNKED:
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
    if "parts" in entry or "base" in entry:  # references: parsed field by field
        return None
    value, prefix = entry.get("value"), entry.get("prefix")
    if prefix is not None and (type(prefix) is not str or prefix_problem(prefix) is not None):
        return None
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
    return MetadataIndex(fqn, chunk), Extent(file, offset, length, raw, codec, cs, value,
                                               prefix)


def decode_storage_meta(p: FieldParser, root: dict[str, Any]) -> StorageMeta:
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


def decode_dcp_version(p: FieldParser, root: dict[str, Any]) -> str | None:
    dcp_version = root.get("dcp_version")
    if dcp_version is not None and not isinstance(dcp_version, str):
        raise p.fail("dcp_version", f"expected a string or null, got {type(dcp_version).__name__}")
    return None if dcp_version is None else p.text(dcp_version, "dcp_version")
