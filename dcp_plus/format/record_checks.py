"""What a commit record must satisfy before any data is read: the rules that make a decoded
record safe to act on (every tensor loaded whole, every read bounded, nothing aliased).

``decode_record`` applies them; they are kept here so that the schema parsing in
``record.py`` stays readable.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.extent import BYTESIO, Extent
from dcp_plus.format.parts import CHUNKED, own_span, references
from dcp_plus.format.parts import INT64_MAX as INT64_MAX  # the bound every format module uses

MAX_DIMS = 64

_STORED = [
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16",
]
STORED_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _STORED if isinstance(getattr(torch, n, None), torch.dtype)}
"""The dtypes a dcp_plus writer stores (as raw bytes), by record name; nothing else loads."""

_PREFIX, _PARTS, _BASE, _CODEC = (operator.attrgetter(n) for n in ("prefix", "parts", "base",
                                                                  "codec"))

Fail = Callable[[str, str], CheckpointFormatError]
"""``fail(field, problem)``: the error to raise, naming the field and the record."""


def check_tiling(size: torch.Size, chunks: list[ChunkStorageMetadata], field: str,
                 fail: Fail) -> None:
    """The chunks of a tensor of ``size`` cover every element exactly once.

    Each chunk already lies inside the tensor; so chunks that are pairwise disjoint and whose
    volumes add up to the tensor's element count tile it. Empty chunks hold nothing and are
    allowed (an FSDP rank whose shard of an unevenly split tensor is empty saves one).
    """
    numel = math.prod(size)
    if numel == 0:
        return
    if not chunks:
        raise fail(field, f"no chunks for a tensor of {numel} elements: it would not be loaded")
    where = [i for i, c in enumerate(chunks) if math.prod(c.sizes)]
    solid = [chunks[i] for i in where]
    total = sum(math.prod(c.sizes) for c in solid)
    if total != numel:
        raise fail(field, f"the chunks hold {total} elements, the tensor has {numel}: they "
                          "do not tile it")
    if _is_grid(solid):
        return
    overlap = _first_overlap(solid, fail, field)
    if overlap is not None:
        raise fail(field, f"chunks {where[overlap[0]]} and {where[overlap[1]]} overlap")


def _is_grid(chunks: list[ChunkStorageMetadata]) -> bool:
    """Whether the chunks are provably disjoint as a grid: no chunk repeats, and along every
    dimension any two of their intervals are equal or disjoint (so two different chunks
    differ in some dimension's interval, which are then disjoint). Every DTensor and FSDP
    sharding is one; O(n log n)."""
    if len(set(map(_key, chunks))) != len(chunks):
        return False
    for d in range(len(chunks[0].offsets)):
        spans = sorted({(c.offsets[d], c.sizes[d]) for c in chunks})
        if any(a + n > b for (a, n), (b, _) in itertools.pairwise(spans)):
            return False
    return True


def _key(c: ChunkStorageMetadata) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(c.offsets), tuple(c.sizes)


def _first_overlap(chunks: list[ChunkStorageMetadata], fail: Fail,
                   field: str) -> tuple[int, int] | None:
    """Two overlapping chunks of a layout that is not a grid, by a sweep along the dimension
    with the most distinct offsets; refused past ~16 comparisons per chunk (no sharding DCP
    writes needs the sweep at all, so a record that does is broken or hostile: the bound keeps
    its cost linear)."""
    ndim = len(chunks[0].offsets)
    if ndim == 0:
        return (0, 1) if len(chunks) > 1 else None
    lo = [tuple(c.offsets) for c in chunks]
    hi = [tuple(o + n for o, n in zip(c.offsets, c.sizes, strict=True)) for c in chunks]
    d = max(range(ndim), key=lambda k: len({x[k] for x in lo}))
    order = sorted(range(len(chunks)), key=lambda i: lo[i][d])
    budget = 16 * len(chunks) + 4096
    active: list[int] = []
    for i in order:
        active = [j for j in active if hi[j][d] > lo[i][d]]
        budget -= len(active) + 1
        if budget < 0:
            raise fail(field, f"{len(chunks)} chunks in an irregular layout too costly to "
                              "check for overlaps; no dcp_plus writer produces one")
        a_lo, a_hi = lo[i], hi[i]
        for j in active:
            b_lo, b_hi = lo[j], hi[j]
            for k in range(ndim):
                if a_lo[k] >= b_hi[k] or b_lo[k] >= a_hi[k]:
                    break
            else:
                return min(i, j), max(i, j)
        active.append(i)
    return None


def check_extents_match_items(
        items: Mapping[str, TensorStorageMetadata | BytesStorageMetadata],
        storage: Mapping[MetadataIndex, Extent], rows: Mapping[MetadataIndex, int],
        fail: Fail) -> None:
    """Extents and items correspond one to one, with the lengths the items imply: each
    tensor chunk has one extent of exactly its bytes, each value one uncompressed extent.

    ``rows`` gives each extent's row in the record, for the messages.
    """
    multi: dict[str, dict[tuple[int, ...], torch.Size]] = {}
    values = 0
    for index, ext in storage.items():
        md = items[index.fqn]
        if isinstance(md, BytesStorageMetadata):
            values += 1
            if index.offset is not None or ext.codec != "identity" or \
                    ext.value not in (None, BYTESIO):
                _value_extent_problem(index, ext, f"extents[{rows[index]}]", fail)
        else:
            sizes = _chunk_sizes(md, index, multi)
            if ext.value is not None or sizes is None or \
                    ext.raw_length != math.prod(sizes) * md.properties.dtype.itemsize:
                _tensor_extent_problem(md, index, ext, sizes, f"extents[{rows[index]}]", fail)
        if ext.codec == "identity" and ext.length != ext.raw_length:
            raise fail(f"extents[{rows[index]}]", f"{index.fqn!r}: uncompressed extent with "
                                                  f"length {ext.length} != raw_length "
                                                  f"{ext.raw_length}")
    # Each extent is a distinct chunk or value of its item (keys are unique, and each was
    # found above), so equal counts mean every chunk and value has one.
    stored = sum(len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
                 for md in items.values())
    if stored != len(storage):
        _check_every_item_stored(items, storage, fail)


def _chunk_sizes(md: TensorStorageMetadata, index: MetadataIndex,
                 multi: dict[str, dict[tuple[int, ...], torch.Size]]) -> torch.Size | None:
    """The sizes of the chunk of ``md`` at ``index.offset`` (None: no such chunk)."""
    if index.offset is None:
        return None
    chunks = md.chunks
    if len(chunks) == 1:
        return chunks[0].sizes if chunks[0].offsets == index.offset else None
    table = multi.get(index.fqn)
    if table is None:
        table = multi[index.fqn] = {tuple(c.offsets): c.sizes for c in chunks}
    return table.get(tuple(index.offset))


def _value_extent_problem(index: MetadataIndex, ext: Extent, where: str, fail: Fail) -> None:
    if index.offset is not None:
        raise fail(f"{where}.chunk", f"{index.fqn!r} is a value, not a tensor chunk")
    if ext.codec != "identity":
        raise fail(f"{where}.codec", f"value {index.fqn!r}: values are stored uncompressed")
    raise fail(f"{where}.value", f"value {index.fqn!r}: unknown value kind {ext.value!r}")


def _tensor_extent_problem(md: TensorStorageMetadata, index: MetadataIndex, ext: Extent,
                           sizes: torch.Size | None, where: str, fail: Fail) -> None:
    if ext.value is not None:
        raise fail(f"{where}.value", f"tensor {index.fqn!r}: tensor extents have no value kind")
    if sizes is None:
        raise fail(f"{where}.chunk", f"tensor {index.fqn!r} has no chunk at "
                                     f"{None if index.offset is None else list(index.offset)}")
    nbytes = math.prod(sizes) * md.properties.dtype.itemsize
    raise fail(f"{where}.raw_length",
               f"tensor {index.fqn!r}: {ext.raw_length} bytes, but chunk {list(sizes)} of "
               f"{str(md.properties.dtype).removeprefix('torch.')} holds {nbytes}")


def _check_every_item_stored(items: Mapping[str, TensorStorageMetadata | BytesStorageMetadata],
                             storage: Mapping[MetadataIndex, Extent], fail: Fail) -> None:
    for fqn, md in items.items():
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise fail("extents", f"no extent recorded for value {fqn!r}")
            continue
        for c in md.chunks:
            if MetadataIndex(fqn, c.offsets) not in storage:
                chunk = f" chunk {list(c.offsets)}" if any(c.offsets) else ""
                raise fail("extents", f"no extent recorded for tensor {fqn!r}{chunk}")


def check_no_aliasing(extents: Mapping[MetadataIndex, Extent], fail: Fail) -> None:
    """No two non-empty extents share a byte of a data file: a writer never stores two items
    in one place (``extents`` in record order)."""
    by_file: dict[Any, list[Extent]] = {}
    for ext in extents.values():
        if ext.length:  # a file of another checkpoint (a reference) is another file
            by_file.setdefault(ext.file if ext.base is None else (ext.base, ext.file),
                               []).append(ext)
    for spans in by_file.values():
        starts = [e.offset for e in spans]
        ends = [e.offset + e.length for e in spans]
        if not all(map(operator.le, starts, starts[1:])):  # not in file order: sort them
            order = sorted(range(len(starts)), key=starts.__getitem__)
            starts, ends = [starts[i] for i in order], [ends[i] for i in order]
        if any(map(operator.lt, starts[1:], ends)):
            _first_alias(extents, fail)


def _first_alias(extents: Mapping[MetadataIndex, Extent], fail: Fail) -> None:
    """Raise naming the first two extents that share bytes, in (file, offset) order."""
    by_file: dict[tuple[str | None, str], list[tuple[int, int, int, str]]] = {}
    for row, (index, ext) in enumerate(extents.items()):
        if ext.length:
            by_file.setdefault((ext.base, ext.file), []).append((ext.offset, ext.length, row,
                                                                 index.fqn))
    for (_, name), spans in by_file.items():
        spans.sort()
        end, prev, prev_fqn = -1, -1, ""
        for offset, length, row, fqn in spans:
            if offset < end:
                raise fail(f"extents[{row}]", f"the bytes {offset}..{offset + length} of "
                                              f"{name!r} it gives {fqn!r} are also those of "
                                              f"extents[{prev}] ({prev_fqn!r})")
            end, prev, prev_fqn = offset + length, row, fqn


def check_prefixes(extents: Mapping[MetadataIndex, Extent], rows: Mapping[MetadataIndex, int],
                   allowed: bool, fail: Fail) -> None:
    """Key prefixes only where the record's version has them, and one per data file (each
    prefix itself was validated with its row)."""
    if not any(map(_PREFIX, extents.values())):  # the common case, checked at C speed
        return
    prefix_of: dict[Any, str | None] = {}
    for index, ext in extents.items():
        if ext.prefix is not None and not allowed:
            raise fail(f"extents[{rows[index]}].prefix", "key prefixes need a version-3 record")
        key = ext.file if ext.base is None else (ext.base, ext.file)
        if prefix_of.setdefault(key, ext.prefix) != ext.prefix:
            raise fail(f"extents[{rows[index]}].prefix",
                       f"{ext.file!r} is also recorded under key prefix {prefix_of[key]!r}")


def check_references(extents: Mapping[MetadataIndex, Extent], rows: Mapping[MetadataIndex, int],
                     bases: list[str] | None, fail: Fail) -> None:
    """Chunked extents and references to sibling checkpoints only in a record that lists its
    ``bases`` (version 5; None: an older one), each one consistent: a chunked extent's parts
    hold its raw bytes, its own parts lie in its ``file`` span, and every checkpoint it or a
    reference names is one of the record's ``bases``."""
    values = extents.values()
    if not (any(map(_PARTS, values)) or any(map(_BASE, values))
            or CHUNKED in set(map(_CODEC, values))):
        return  # no reference anywhere (checked at C speed: 100,000 extents in ~10 ms)
    listed = set(bases or ())
    for index, ext in extents.items():
        if ext.parts is None and ext.base is None and ext.codec != CHUNKED:
            continue
        where = f"extents[{rows[index]}]"
        if bases is None:
            raise fail(where, "parts and base references need a version-5 record")
        named = references(ext.parts or ()) | ({ext.base} if ext.base else set())
        if named - listed:
            raise fail(where, f"names checkpoint {sorted(named - listed)[0]!r}, which is not "
                              "one of the record's bases")
        if ext.parts is None:  # writers reference only extents stored as parts
            raise fail(where, "a base reference or a chunked extent without parts")
        if ext.codec != CHUNKED or ext.value is not None:
            raise fail(where, f"an extent with parts has codec {CHUNKED!r} and no value kind")
        total = sum(p.raw for p in ext.parts)
        if total != ext.raw_length:
            raise fail(f"{where}.parts", f"the parts hold {total} bytes, the extent "
                                         f"{ext.raw_length}")
        try:
            span = own_span(ext.parts)
        except ValueError as e:
            raise fail(f"{where}.parts", str(e)) from None
        if span != (ext.file, ext.offset, ext.length):
            raise fail(where, "file, offset and length are not the span of the parts it "
                              f"stores itself ({span})")
