"""The columnar commit record (version 4): one JSON list per field instead of one object per
item and per extent, so that a record of 100,000 tensors parses and validates in a fraction
of a second.

Layout (``n`` items, ``m`` extents; every list of a table has its table's length)::

    "items":   {"fqn": [str], "dtype": [str | null], "requires_grad": [bool | null],
                "size": [[int] | null]}            # null dtype: a bytes value
    "files":   [str], "prefixes": [str | null]     # prefixes optional, one per file
    "codecs":  [str]
    "extents": {"item": [int], "offsets": [[int] | null], "sizes": [[int] | null],  # null:
                "file": [int], "offset": [int], "length": [int], "raw_length": [int],
                "codec": [int], "checksum": [str], "value": [str | null]}  # value optional

An extent row is one stored piece: a tensor chunk (its offsets and sizes; null for both: the
whole tensor) or a value (null for both); a tensor's chunks are its rows, in row order. Columns are checked whole with builtins
(types, ranges, lengths); a failing column is then walked to name the first bad entry. The
decoded ``Metadata`` is the one a version-2 record gives, and the rules of
:mod:`~dcp_plus.format.record_checks` run on it all the same.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_plus.format.bulk import metadata_indexes
from dcp_plus.format.checksum import BOUND_ALGORITHM
from dcp_plus.format.column_checks import check_extent_columns, in_order_and_apart, nones
from dcp_plus.format.columns import Columns
from dcp_plus.format.columns_encode import CHUNK_COLUMNS
from dcp_plus.format.extent import Extent
from dcp_plus.format.extent_columns import (
    LOCATION_COLUMNS,
    check_locations,
    extents_of,
)
from dcp_plus.format.record_checks import (
    INT64_MAX,
    STORED_DTYPES,
    check_no_aliasing,
    check_tiling,
)
from dcp_plus.format.record_fields import FieldParser

_CHECKSUMS = re.compile(rf"(?:{BOUND_ALGORITHM}:[0-9a-f]{{16}})*")
_ITEM_COLUMNS = ("fqn", "dtype", "requires_grad", "size")
_EXTENT_COLUMNS = CHUNK_COLUMNS + LOCATION_COLUMNS

Decoded = tuple[dict[str, TensorStorageMetadata | BytesStorageMetadata],
                dict[MetadataIndex, Extent], Mapping[MetadataIndex, int]]


# ------------------------------------------------------------------------------------ decode

def decode_columns(p: FieldParser, root: dict[str, Any]) -> Decoded:
    """``(items, extents, rows)`` of a version-4 record, every field checked, its extents
    matched to its items and none sharing a byte with another; the other rules of
    :mod:`~dcp_plus.format.record_checks` are the caller's."""
    it = Columns(p, p.get(root, "items", dict, ""), "items", _ITEM_COLUMNS)
    fqns = it.texts("fqn")
    if len(set(fqns)) != len(fqns):
        seen: set[str] = set()
        dupe = next(f for f in fqns if f in seen or seen.add(f))  # type: ignore[func-returns-value]
        raise p.fail("items.fqn", f"{dupe[:80]!r} is listed twice")
    names = p.get(root, "dtypes", list, "")
    for i, d in enumerate(names):
        if type(d) is not str or d not in STORED_DTYPES:
            raise p.fail(f"dtypes[{i}]", f"unknown dtype {str(d)[:80]!r} (dcp_plus stores "
                                         f"{', '.join(STORED_DTYPES)})")
    dtypes = it.column("dtype")
    tensor = list(map(operator.is_not, dtypes, itertools.repeat(None)))
    codes = list(itertools.compress(dtypes, tensor))
    if codes and not (set(map(type, codes)) == {int} and min(codes) >= 0
                      and max(codes) < len(names)):
        raise it.bad("dtype", dtypes, lambda d: d is None or (
            type(d) is int and 0 <= d < len(names)), f"null or an index into the {len(names)} "
                                                      "dtypes")
    grads = it.column("requires_grad")
    tensor_grads = list(itertools.compress(grads, tensor))
    if not set(map(type, tensor_grads)) <= {bool} or \
            nones(grads) != len(grads) - len(tensor_grads):
        raise it.bad("requires_grad", grads, lambda g: type(g) in (bool, type(None)),
                     "a bool for a tensor, null for a value")
    sizes = it.shapes("size")
    if list(map(operator.is_not, sizes, itertools.repeat(None))) != tensor:
        i = next(i for i, (s, t) in enumerate(zip(sizes, tensor, strict=True))
                 if (s is not None) != t)
        raise p.fail(f"items.size[{i}]", "expected a list for a tensor, null for a value")
    shared: dict[Any, TensorProperties | None] = {
        (d, g): TensorProperties(dtype=STORED_DTYPES[names[d]], requires_grad=g)
        for d, g in set(zip(codes, tensor_grads, strict=True))}
    props = list(map(shared.get, zip(dtypes, grads, strict=True)))  # None: a value
    lists = list(itertools.compress(sizes, tensor))
    if lists and max(map(math.prod, lists)) * max(
            pr.dtype.itemsize for pr in shared.values() if pr is not None) > INT64_MAX:
        _check_bytes(p, sizes, props, names, dtypes)
    ex = Columns(p, p.get(root, "extents", dict, ""), "extents", _EXTENT_COLUMNS)
    item = ex.ints("item", below=len(fqns))
    row_tensor = list(map(tensor.__getitem__, item))
    offsets, chunk_sizes = ex.shapes("offsets", row_tensor), ex.shapes("sizes", row_tensor)
    explicit = [r for r, o in enumerate(offsets) if o is not None]
    if explicit != [r for r, s in enumerate(chunk_sizes) if s is not None]:
        r = next(r for r, (o, s) in enumerate(zip(offsets, chunk_sizes, strict=True))
                 if (o is None) != (s is None))
        raise p.fail(f"extents[{r}]", "offsets and sizes are both lists or both null")
    _check_chunks_fit(p, item, offsets, chunk_sizes, sizes, explicit)
    locations = check_locations(p, root, ex)
    extents = list(extents_of(locations))
    shapes, distinct = _interned(sizes)
    chunks = _chunks(item, offsets, chunk_sizes, sizes, shapes, distinct, not explicit)
    sd_md = _items(p, fqns, props, shapes, item, chunks)
    indexes = metadata_indexes(list(map(fqns.__getitem__, item)),
                               [None if c is None else c.offsets for c in chunks])
    storage = dict(zip(indexes, extents, strict=True))
    if len(storage) != len(indexes):
        first: dict[MetadataIndex, int] = {}
        r = next(r for r, index in enumerate(indexes) if first.setdefault(index, r) != r)
        raise p.fail(f"extents[{r}]", f"a second extent for the same item as "
                                      f"extents[{first[indexes[r]]}]")
    rows = _Rows(indexes)
    check_extent_columns(item, chunks, props, locations, sd_md, storage, rows, p.fail)
    if not in_order_and_apart(locations):
        check_no_aliasing(storage, p.fail)
    return sd_md, storage, rows


def _check_bytes(p: FieldParser, sizes: list[Any], props: list[TensorProperties | None],
                 names: list[str], dtypes: list[Any]) -> None:
    """No tensor larger than 2^63 bytes."""
    for i, (s, pr) in enumerate(zip(sizes, props, strict=True)):
        if pr is not None and math.prod(s) * pr.dtype.itemsize > INT64_MAX:
            raise p.fail(f"items.size[{i}]", f"a tensor of {s} {names[dtypes[i]]} is larger "
                                             "than 2^63 bytes")


_SIZES = operator.attrgetter("sizes")


class _Rows(Mapping[MetadataIndex, int]):
    """Each extent's row, for error messages only: built when first asked."""

    def __init__(self, indexes: list[MetadataIndex]) -> None:
        self._indexes = indexes
        self._rows: dict[MetadataIndex, int] | None = None

    def _table(self) -> dict[MetadataIndex, int]:
        if self._rows is None:
            self._rows = {index: r for r, index in enumerate(self._indexes)}
        return self._rows

    def __getitem__(self, index: MetadataIndex) -> int:
        return self._table()[index]

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._indexes)


def _interned(sizes: list[Any]) -> tuple[list[torch.Size | None], list[torch.Size]]:
    """Each size as a ``torch.Size`` (None for a value's), one object per distinct shape (a
    model's layers repeat theirs), and those shapes."""
    keys = [None if s is None else tuple(s) for s in sizes]
    table = {k: torch.Size(k) for k in set(keys) if k is not None}
    return list(map(table.get, keys)), list(table.values())  # type: ignore[arg-type]


def _chunks(item: list[int], offsets: list[Any], sizes: list[Any], shape: list[Any],
            shapes: list[torch.Size | None], distinct: list[torch.Size], all_whole: bool
            ) -> list[ChunkStorageMetadata | None]:
    """Each row's chunk (None for a value's). A whole tensor's chunk is shared by every
    tensor of its shape (nothing changes a decoded record's chunks); all-zero offsets of
    a rank share one ``torch.Size``."""
    zeros = {n: torch.Size([0] * n) for n in {len(t) for t in distinct}}
    whole = {t: ChunkStorageMetadata(zeros[len(t)], t) for t in distinct}
    if all_whole:
        return list(map(whole.get, map(shapes.__getitem__, item)))  # type: ignore[arg-type]
    out: list[ChunkStorageMetadata | None] = []
    for i, o, s in zip(item, offsets, sizes, strict=True):
        t = shapes[i]
        if t is None:
            out.append(None)
        elif o is None or (s == shape[i] and not any(o)):
            out.append(whole[t])
        else:
            out.append(ChunkStorageMetadata(torch.Size(o), torch.Size(s)))
    return out


def _check_chunks_fit(p: FieldParser, item: list[int], offsets: list[Any], sizes: list[Any],
                      shape: list[Any], explicit: list[int]) -> None:
    """Each chunk given explicitly has its tensor's dimensions and lies inside it."""
    dims = [len(shape[item[r]]) for r in explicit]
    if list(map(len, (offsets[r] for r in explicit))) == dims == \
            list(map(len, (sizes[r] for r in explicit))):
        chain = itertools.chain.from_iterable
        ends = map(operator.add, chain(offsets[r] for r in explicit),
                   chain(sizes[r] for r in explicit))
        if not any(map(operator.gt, ends, chain(shape[item[r]] for r in explicit))):
            return
    for r in explicit:
        o, s, t = offsets[r], sizes[r], shape[item[r]]
        if len(o) != len(t) or len(s) != len(t) or any(
                a + n > b for a, n, b in zip(o, s, t, strict=True)):
            raise p.fail(f"extents[{r}]", f"chunk at {o} of size {s} does not fit in a "
                                          f"tensor of size {t}")


def _items(p: FieldParser, fqns: list[str], props: list[TensorProperties | None],
           shapes: list[torch.Size | None], item: list[int],
           chunks: list[ChunkStorageMetadata | None]
           ) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """The items, each tensor with its rows' chunks (in row order), each checked to tile it."""
    if len(item) == len(fqns) == len(set(item)):  # one row per item: no grouping
        mine: list[Any] = chunks
        if item != list(range(len(item))):  # rows in another order than their items
            mine = [None] * len(fqns)
            for i, c in zip(item, chunks, strict=True):
                mine[i] = c
        if nones(mine):
            odd = [i for i, (c, t) in enumerate(zip(mine, shapes, strict=True))
                   if c is None or c.sizes is not t]
        else:  # whole chunks share their tensor's Size (see _chunks)
            odd = list(itertools.compress(range(len(mine)), map(
                operator.is_not, map(_SIZES, mine), shapes)))
        out: dict[str, TensorStorageMetadata | BytesStorageMetadata] = dict(zip(
            fqns, map(TensorStorageMetadata, props, shapes,  # type: ignore[arg-type]
                      map(list, zip(mine, strict=True))),
            strict=True))
        for i in odd:
            out[fqns[i]] = _item(p, fqns[i], props[i], shapes[i], [mine[i]])
        return out
    of: list[list[ChunkStorageMetadata]] = [[] for _ in fqns]
    for i, c in zip(item, chunks, strict=True):
        if c is not None:
            of[i].append(c)
    return {fqn: _item(p, fqn, pr, size, cs)
            for fqn, pr, size, cs in zip(fqns, props, shapes, of, strict=True)}


def _item(p: FieldParser, fqn: str, props: TensorProperties | None, size: torch.Size | None,
          chunks: list[ChunkStorageMetadata]) -> TensorStorageMetadata | BytesStorageMetadata:
    if props is None or size is None:
        return BytesStorageMetadata()
    if len(chunks) != 1 or chunks[0].sizes is not size:  # not one whole chunk: check the tiling
        check_tiling(size, chunks, f"items[{fqn[:80]!r}].chunks", p.fail)
    return TensorStorageMetadata(props, size, chunks)
