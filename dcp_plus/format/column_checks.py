"""The extents-against-items rule of a columnar record, checked on its columns: a few C-level
passes over each column instead of a Python loop per extent. Any failure hands over to
:func:`~dcp_plus.format.record_checks.check_extents_match_items`, which walks the extents and
names the first bad one, so that the rule and its messages live in one place."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_plus.format.extent import BYTESIO, Extent
from dcp_plus.format.extent_columns import Locations
from dcp_plus.format.record_checks import Fail, check_extents_match_items

_SIZES = operator.attrgetter("sizes")


def check_extent_columns(
        item: list[int], chunks: list[ChunkStorageMetadata | None],
        props: list[TensorProperties | None], locations: Locations,
        items: Mapping[str, TensorStorageMetadata | BytesStorageMetadata],
        storage: Mapping[MetadataIndex, Extent], rows: Mapping[MetadataIndex, int],
        fail: Fail) -> None:
    """:func:`~dcp_plus.format.record_checks.check_extents_match_items` for a columnar
    record whose row ``r`` stores chunk ``chunks[r]`` (None: a value) of item ``item[r]``
    (rows unique, each chunk built from its own row, so it is one of its item's)."""
    if not _fit(item, chunks, props, locations):
        check_extents_match_items(items, storage, rows, fail)
        raise fail("extents", "an extent does not match its item")  # not reached


def _fit(item: list[int], chunks: list[ChunkStorageMetadata | None],
         props: list[TensorProperties | None], locations: Locations) -> bool:
    _, _, codecs, c = locations
    raw, length, codec, value = c["raw_length"], c["length"], c["codec"], c["value"]
    identity = codecs.index("identity") if "identity" in codecs else -1
    itemsize = [0 if pr is None else pr.dtype.itemsize for pr in props]
    values = nones(chunks)
    if values != nones(props):  # a value without its extent
        return False
    if values == 0:
        if value.count(None) != len(value):
            return False
        expected = list(map(operator.mul, map(math.prod, map(_SIZES, chunks)),
                            map(itemsize.__getitem__, item)))
    else:
        for ch, v, k in zip(chunks, value, codec, strict=True):
            if (v is not None) if ch is not None else (v not in (None, BYTESIO) or
                                                        k != identity):
                return False
        expected = [r if ch is None else math.prod(ch.sizes) * itemsize[i]
                    for i, ch, r in zip(item, chunks, raw, strict=True)]
    if expected != raw:
        return False
    if codec.count(identity) == len(codec):
        return length == raw
    return all(n == r for n, r, k in zip(length, raw, codec, strict=True) if k == identity)


def nones(values: list[Any]) -> int:
    """``values.count(None)`` by identity: ``list.count`` calls a dataclass's Python
    ``__eq__`` on every other element."""
    return sum(map(operator.is_, values, itertools.repeat(None)))


def in_order_and_apart(locations: Locations) -> bool:
    """True when the non-empty extents of ``locations`` are in (file, offset) order, as a
    writer records them, and none overlaps the next: no two share a byte, decided in a few
    C-level passes. False when it is not decided that way (references to other checkpoints,
    another order, an overlap): :func:`~dcp_plus.format.record_checks.check_no_aliasing`
    then decides, and names the culprits."""
    _, _, _, c = locations
    if nones(c["base"]) != len(c["base"]):
        return False
    keep = list(map(bool, c["length"]))
    file, offset, length = (list(itertools.compress(c[k], keep))
                            for k in ("file", "offset", "length"))
    at = list(zip(file, offset, strict=True))
    if not all(map(operator.le, at, at[1:])):
        return False
    ends = list(map(operator.add, offset, length))
    return not any(map(operator.and_, map(operator.eq, file[1:], file),
                       map(operator.lt, offset[1:], ends)))
