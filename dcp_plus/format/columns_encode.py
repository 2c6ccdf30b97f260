"""Encoding the columnar commit record (version 4; its layout: :mod:`record_columns`): the
structure's fields, the extents' chunk columns and their locations, each apart so that a
save of an unchanged structure can reuse the first two (:mod:`record_memo`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.column_checks import nones
from dcp_plus.format.extent import Extent
from dcp_plus.format.extent_columns import chunk_key, encode_locations
from dcp_plus.format.extent_set import ExtentSet

CHUNK_COLUMNS = ("item", "offsets", "sizes")


class ItemIndex(NamedTuple):
    """Where an extent's chunk columns come from: each item's position, its tensor metadata
    (None: a value) and, for a tensor stored whole, its dimension count (-1 otherwise)."""

    position: dict[str, int]
    tensors: list[TensorStorageMetadata | None]
    whole: list[int]


def encode_columns(metadata: Metadata, extents: Mapping[MetadataIndex, Extent],
                   dtype_name: Callable[[torch.dtype], str]) -> dict[str, Any]:
    """The ``items``, ``files``, ``prefixes``, ``codecs`` and ``extents`` fields of a
    version-4 record.

    Raises:
        CheckpointFormatError: an extent of no item or chunk, or a chunk without an extent
            (the columnar form stores each chunk with its extent).
    """
    index = item_index(metadata)
    fields = encode_items(metadata, dtype_name, index.tensors)
    tables, locations = extent_locations(extents)
    return {**fields, **tables, "extents": {
        **encode_chunk_table(extent_keys(extents), index), **locations}}


def _tensors(metadata: Metadata) -> list[TensorStorageMetadata | None]:
    return [md if isinstance(md, TensorStorageMetadata) else None
            for md in metadata.state_dict_metadata.values()]


def encode_items(metadata: Metadata, dtype_name: Callable[[torch.dtype], str],
                 tensors: list[TensorStorageMetadata | None] | None = None) -> dict[str, Any]:
    """The ``dtypes`` and ``items`` fields: what the state-dict structure alone decides
    (``tensors``: each item's tensor metadata, as :func:`item_index` has it)."""
    sd_md = metadata.state_dict_metadata
    if tensors is None:
        tensors = _tensors(metadata)
    dtypes: dict[str, int] = {}
    dtype_at: dict[torch.dtype, int] = {}  # a dtype's name looked up once, not per item

    def dtype_index(dtype: torch.dtype) -> int:
        at = dtype_at.get(dtype)
        if at is None:
            at = dtype_at[dtype] = dtypes.setdefault(dtype_name(dtype), len(dtypes))
        return at

    items = {
        "fqn": list(sd_md),
        "dtype": [None if md is None else dtype_index(md.properties.dtype) for md in tensors],
        "requires_grad": [None if md is None else bool(md.properties.requires_grad)
                          for md in tensors],
        "size": [None if md is None else list(md.size) for md in tensors],
    }
    return {"dtypes": list(dtypes), "items": items}


def item_index(metadata: Metadata) -> ItemIndex:
    sd_md = metadata.state_dict_metadata
    tensors = _tensors(metadata)
    # dims of each tensor stored as one chunk at offset 0 (its extents' columns are null)
    whole = [-1 if md is None or len(md.chunks) != 1 or any(md.chunks[0].offsets)
             or md.chunks[0].sizes != md.size else len(md.size) for md in tensors]
    return ItemIndex({fqn: i for i, fqn in enumerate(sd_md)}, tensors, whole)


def extent_keys(extents: Mapping[MetadataIndex, Extent]) -> Iterable[tuple[str, Any]]:
    """``(fqn, offsets)`` of each extent, in order."""
    if isinstance(extents, ExtentSet):  # columns in, columns out: no object per extent
        return zip(extents.fqn, map(chunk_key, extents.chunk), strict=True)
    return ((i.fqn, i.offset) for i in extents)


def extent_locations(extents: Mapping[MetadataIndex, Extent]
                     ) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The ``files`` / ``prefixes`` / ``codecs`` fields and the extents' location columns."""
    if isinstance(extents, ExtentSet):
        return extents.locations()
    return encode_locations(extents.values())


def encode_chunk_table(keys: Iterable[tuple[str, Any]], index: ItemIndex
                       ) -> dict[str, list[Any]]:
    """The extents' ``item``, ``offsets`` and ``sizes`` columns (null offsets and sizes: the
    whole tensor).

    Raises:
        CheckpointFormatError: an extent of no item or chunk, or a chunk without an extent.
    """
    position, tensors, whole = index
    table: dict[str, list[Any]] = {k: [] for k in CHUNK_COLUMNS}
    item, offsets, sizes = (x.append for x in table.values())
    for fqn, offset in keys:
        i = position.get(fqn)
        if i is not None and offset is not None and whole[i] == len(offset) and not any(offset):
            item(i)
            offsets(None)
            sizes(None)
            continue
        row = _chunk_columns(fqn, offset, position, tensors)
        item(row[0])
        offsets(row[1])
        sizes(row[2])
    stored = sum(len(md.chunks) for md in tensors if md is not None) + nones(tensors)
    if stored != len(table["item"]):
        raise CheckpointFormatError(f"{len(table['item'])} extents for {stored} stored chunks "
                                    "and values: every chunk and value has exactly one extent")
    return table


def _chunk_columns(fqn: str, offset: tuple[int, ...] | None, position: Mapping[str, int],
                   tensors: list[TensorStorageMetadata | None]) -> tuple[Any, ...]:
    """``(item, offsets, sizes)`` of the extent of item ``fqn`` at chunk ``offset``."""
    item = position.get(fqn)
    if item is None:
        raise CheckpointFormatError(f"an extent for {fqn!r}, which is no item")
    md = tensors[item]
    offsets = sizes = None
    if md is not None:
        chunk = _chunk_at(md, offset)
        if chunk is None:
            raise CheckpointFormatError(f"an extent for tensor {fqn!r} at "
                                        f"{offset}, where it has no chunk")
        if chunk.sizes != md.size or any(chunk.offsets):  # else null: the whole tensor
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
    return item, offsets, sizes


def _chunk_at(md: TensorStorageMetadata, offset: tuple[int, ...] | None
              ) -> ChunkStorageMetadata | None:
    if offset is None:
        return None
    if md.chunks and md.chunks[0].offsets == offset:
        return md.chunks[0]
    return next((c for c in md.chunks if c.offsets == offset), None)
