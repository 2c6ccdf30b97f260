"""Extents as columns: where they lie (files, offsets, lengths, codecs, checksums: the part
a columnar record's extent table shares with a rank's), and a rank's extent table, the
file through which a rank hands its extents to the coordinator in a multi-rank save.

Fields (``m`` extents)::

    "files": [str], "prefixes": [str | null]       # prefixes optional, one per file
    "codecs": [str]
    columns: "file": [int], "offset": [int], "length": [int], "raw_length": [int],
             "codec": [int], "checksum": [str], "value": [str | null]   # value optional
             "base": [str | null], "parts": [[part] | null]   # optional (version 5)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.bulk import extents
from dcp_plus.format.checksum import BOUND_ALGORITHM
from dcp_plus.format.codecs import known_codec
from dcp_plus.format.columns import Columns
from dcp_plus.format.extent import Extent
from dcp_plus.format.key_prefix import prefix_problem
from dcp_plus.format.parts import CHUNKED, parse_parts, part_json, sibling_problem
from dcp_plus.format.record_checks import INT64_MAX, MAX_DIMS
from dcp_plus.format.record_fields import FieldParser
from dcp_plus.format.strict_json import loads_strict

EXTENT_TABLE_FORMAT = "dcp_plus-extents"
EXTENT_TABLE_VERSION = 5
"""Columnar since 4, zero offsets as their count since 5; a table is written and read within
one save, by one dcp_plus."""

LOCATION_COLUMNS = ("file", "offset", "length", "raw_length", "codec", "checksum", "value",
                    "base", "parts")
OPTIONAL_COLUMNS = ("value", "base", "parts")
"""Location columns left out when every entry is null."""
_CHECKSUMS = re.compile(rf"(?:{BOUND_ALGORITHM}:[0-9a-f]{{16}})*")
_CHECKSUM_CHARS = len(BOUND_ALGORITHM) + 17


def drop_empty(cols: dict[str, list[Any]]) -> None:
    """Leave out the optional columns that hold nulls only."""
    for name in OPTIONAL_COLUMNS:
        if not any(x is not None for x in cols[name]):
            del cols[name]


def encode_locations(extents: Iterable[Extent]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """``(tables, columns)``: the ``files`` / ``prefixes`` / ``codecs`` fields and the
    location columns of ``extents``, in order.

    Raises:
        CheckpointFormatError: one data file under two key prefixes.
    """
    files: dict[str, int] = {}
    codecs: dict[str, int] = {}
    prefixes: list[str | None] = []
    cols: dict[str, list[Any]] = {k: [] for k in LOCATION_COLUMNS}
    file, offset, length, raw, codec, checksum, value, base, parts = cols.values()
    for ext in extents:
        f = files.setdefault(ext.file, len(files))
        if f == len(prefixes):
            prefixes.append(ext.prefix)
        elif prefixes[f] != ext.prefix:
            raise CheckpointFormatError(f"{ext.file!r} is recorded under two key prefixes")
        file.append(f)
        offset.append(ext.offset)
        length.append(ext.length)
        raw.append(ext.raw_length)
        codec.append(codecs.setdefault(ext.codec, len(codecs)))
        checksum.append(ext.checksum)
        value.append(ext.value)
        base.append(ext.base)
        parts.append(None if ext.parts is None else [part_json(p) for p in ext.parts])
    drop_empty(cols)
    tables: dict[str, Any] = {"files": list(files)}
    if any(prefixes):
        tables["prefixes"] = prefixes
    tables["codecs"] = list(codecs)
    return tables, cols


Locations = tuple[list[str], list[Any], list[str], dict[str, list[Any]]]
"""``(files, prefixes, codecs, columns)``: the tables and the location columns, checked."""


def check_locations(p: FieldParser, root: dict[str, Any], ex: Columns) -> Locations:
    """The location columns of table ``ex`` and the tables of ``root``, every field checked
    (``value`` filled with nulls where it is absent)."""
    files, prefixes, codecs = _tables(p, root)
    file, codec = ex.ints("file", below=len(files)), ex.ints("codec", below=len(codecs))
    offset, length, raw = ex.ints("offset"), ex.ints("length"), ex.ints("raw_length")
    if ex.n and max(map(operator.add, offset, length)) > INT64_MAX:
        i = next(i for i in range(ex.n) if offset[i] + length[i] > INT64_MAX)
        raise p.fail(f"{ex.where}[{i}]", "extent ends beyond the int64 range")
    checksums = ex.column("checksum")
    if set(map(type, checksums)) - {str} or not _CHECKSUMS.fullmatch("".join(checksums)) \
            or (checksums and set(map(len, checksums)) != {_CHECKSUM_CHARS}):
        raise ex.bad("checksum", checksums, lambda c: type(c) is str and _CHECKSUMS.fullmatch(c)
                     is not None and len(c) == _CHECKSUM_CHARS, "a version-4 extent checksum")
    values = ex.texts("value", nullable=True, optional=True)
    bases = ex.texts("base", nullable=True, optional=True)
    parts = ex.column("parts", optional=True)
    if "base" in ex.table:  # the columns of references: absent from other records
        for i, b in enumerate(bases):
            if b is not None and sibling_problem(b) is not None:
                raise p.fail(f"{ex.where}.base[{i}]", str(sibling_problem(b)))
    if "parts" in ex.table:
        parts = [None if v is None else parse_parts(v, p.fail, f"{ex.where}.parts[{i}]",
                                                    p.relative_path)
                 for i, v in enumerate(parts)]
    return files, prefixes, codecs, {"file": file, "offset": offset, "length": length,
                                     "raw_length": raw, "codec": codec, "checksum": checksums,
                                     "value": values, "base": bases, "parts": parts}


def extents_of(locations: Locations) -> Iterator[Extent]:
    """One ``Extent`` per row of checked location columns."""
    files, prefixes, codecs, c = locations
    return iter(extents(map(files.__getitem__, c["file"]), c["offset"], c["length"],
                        c["raw_length"], map(codecs.__getitem__, c["codec"]), c["checksum"],
                        c["value"], map(prefixes.__getitem__, c["file"]), c["base"], c["parts"]))


def _tables(p: FieldParser, root: dict[str, Any]) -> tuple[list[str], list[Any], list[str]]:
    """The ``files`` (relative paths), ``prefixes`` and ``codecs`` (known) tables."""
    files = []
    for i, f in enumerate(p.get(root, "files", list, "")):
        if type(f) is not str:
            raise p.fail(f"files[{i}]", "expected a string")
        files.append(p.relative_path(p.text(f, f"files[{i}]"), f"files[{i}]"))
    if len(set(files)) != len(files):
        raise p.fail("files", "a data file is listed twice")
    prefixes = p.get(root, "prefixes", list, "") if "prefixes" in root else [None] * len(files)
    if len(prefixes) != len(files):
        raise p.fail("prefixes", f"{len(prefixes)} entries for {len(files)} files")
    for i, pre in enumerate(prefixes):
        if pre is not None and prefix_problem(pre) is not None:
            raise p.fail(f"prefixes[{i}]", f"{prefix_problem(pre)}: it could point outside "
                                           "the checkpoint")
    codecs = p.get(root, "codecs", list, "")
    for i, c in enumerate(codecs):
        if type(c) is not str or not (known_codec(c) or c == CHUNKED):
            raise p.fail(f"codecs[{i}]", f"unknown codec {str(c)[:80]!r}")
    return files, prefixes, codecs


def encode_extent_table(extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """One rank's extents, exchanged through storage instead of the process group:
    ``fqn`` and ``chunk`` (offsets; their count when all are 0, so that the coordinator
    parses no list for a whole tensor; null for a value) columns beside the location
    columns."""
    import json

    tables, cols = encode_locations(extents.values())
    return json.dumps({"format": EXTENT_TABLE_FORMAT, "version": EXTENT_TABLE_VERSION,
                       **tables, "extents": {
                           "fqn": [i.fqn for i in extents],
                           "chunk": [None if i.offset is None else list(i.offset)
                                     if any(i.offset) else len(i.offset)
                                     for i in extents], **cols}},
                      separators=(",", ":")).encode()


def decode_extent_table(data: bytes, source: str) -> dict[MetadataIndex, Extent]:
    """Parse :func:`encode_extent_table` output strictly (errors name field and ``source``).
    """
    fqns, chunks, locations = decode_table_columns(data, source)
    table = dict(zip(map(MetadataIndex, fqns, map(chunk_offsets, chunks)),
                     extents_of(locations), strict=True))
    if len(table) != len(fqns):
        raise FieldParser(source).fail("extents", f"{len(fqns) - len(table)} items have two "
                                                  "extents")
    return table


def decode_table_columns(data: bytes, source: str
                         ) -> tuple[list[str], list[Any], Locations]:
    """``(fqns, chunks, locations)`` of :func:`encode_extent_table` output, parsed strictly
    (errors name field and ``source``) into columns: no object per extent."""
    p = FieldParser(source)
    root = loads_strict(data, source, "extent table")
    if p.get(root, "format", str, "") != EXTENT_TABLE_FORMAT:
        raise p.fail("format", f"expected {EXTENT_TABLE_FORMAT!r}")
    if p.get(root, "version", int, "") != EXTENT_TABLE_VERSION:
        raise p.fail("version", f"unsupported version; expected {EXTENT_TABLE_VERSION}")
    ex = Columns(p, p.get(root, "extents", dict, ""), "extents",
                 ("fqn", "chunk") + LOCATION_COLUMNS)
    return ex.texts("fqn"), ex.offsets("chunk"), check_locations(p, root, ex)


def chunk_offsets(chunk: list[int] | int | None) -> list[int] | None:
    """A table's ``chunk`` entry as offsets (a count ``n``: ``n`` zeros)."""
    return [0] * chunk if type(chunk) is int else chunk  # type: ignore[return-value]


_ZEROS = [(0,) * n for n in range(MAX_DIMS + 1)]


def chunk_key(chunk: list[int] | int | None) -> tuple[int, ...] | None:
    """A table's ``chunk`` entry as a tuple of offsets (the zero ones shared)."""
    if chunk is None:
        return None
    return _ZEROS[chunk] if type(chunk) is int else tuple(chunk)  # type: ignore[arg-type]
