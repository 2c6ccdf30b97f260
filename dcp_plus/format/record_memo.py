"""A columnar record's encoding, reusing what the previous save of the same structure
encoded: the state dict's items (and their planner paths), and the extents' chunk columns
while the extents come in the same order.

A plan cache entry stands for one state-dict structure, so a planner that hands the writer
the same :class:`RecordMemo` with every save of that entry lets the coordinator encode only
what changes per save (where the bytes are, their checksums). The bytes are those
:func:`json.dumps` of the whole record gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from dcp_plus.format.columns_encode import (
    encode_chunk_table,
    encode_items,
    extent_keys,
    extent_locations,
    item_index,
)
from dcp_plus.format.extent import Extent
from dcp_plus.format.extent_set import ExtentSet
from dcp_plus.format.planner_data import encode_planner_data, planner_paths

MEMO_ATTRIBUTE = "record_memo"
"""The attribute of a save's ``Metadata`` that holds its structure's :class:`RecordMemo`."""


class RecordMemo:
    """The encoded parts of one state-dict structure's columnar record (see the module)."""

    def __init__(self) -> None:
        self.structure: dict[str, str] | None = None
        """The JSON of ``planner_data``, ``dtypes``, ``items`` and ``planner_paths``."""
        self.chunks: tuple[bytes, str] | None = None
        """(digest of the extents' order, JSON members of their chunk columns): one value,
        so that a save finishing on another thread never pairs one with the other's."""


def record_memo(metadata: Metadata) -> RecordMemo | None:
    memo = getattr(metadata, MEMO_ATTRIBUTE, None)
    return memo if isinstance(memo, RecordMemo) else None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def encode_columnar(head: dict[str, Any], metadata: Metadata,
                    extents: Mapping[MetadataIndex, Extent],
                    dtype_name: Callable[[torch.dtype], str], memo: RecordMemo) -> bytes:
    """The unsealed JSON of a columnar record: the fields of ``head`` (its ``planner_data``
    replaced), then the columns of ``metadata``'s items and of ``extents``; what ``memo``
    holds is reused, what it lacks is added to it.

    Raises:
        CheckpointFormatError: as :func:`~dcp_plus.format.columns_encode.encode_columns`.
    """
    structure = memo.structure
    if structure is None:
        fields = encode_items(metadata, dtype_name)
        paths = planner_paths(metadata.planner_data, fields["items"]["fqn"])
        structure = {"planner_data": _dumps(None if paths is not None
                                            else encode_planner_data(metadata.planner_data)),
                     "dtypes": _dumps(fields["dtypes"]), "items": _dumps(fields["items"])}
        if paths is not None:
            structure["planner_paths"] = _dumps(paths)
        memo.structure = structure
    order = _order_digest(extents)
    chunks = memo.chunks
    if chunks is None or chunks[0] != order:
        chunks = (order, _dumps(encode_chunk_table(extent_keys(extents),
                                                   item_index(metadata)))[1:-1])
        memo.chunks = chunks
    tables, locations = extent_locations(extents)
    members = [(k, _dumps(v)) for k, v in head.items() if k != "planner_data"]
    members.insert(list(head).index("planner_data"), ("planner_data", structure["planner_data"]))
    members += [("dtypes", structure["dtypes"]), ("items", structure["items"])]
    members += [(k, _dumps(v)) for k, v in tables.items()]
    members.append(("extents", "{" + chunks[1] + "," + _dumps(locations)[1:]))
    if "planner_paths" in structure:
        members.append(("planner_paths", structure["planner_paths"]))
    return ("{" + ",".join(f"{_dumps(k)}:{v}" for k, v in members) + "}").encode()


def _order_digest(extents: Mapping[MetadataIndex, Extent]) -> bytes:
    """What the chunk columns depend on besides the structure: each extent's item and chunk
    offsets, in order."""
    if isinstance(extents, ExtentSet):
        fqns, chunks = extents.fqn, extents.chunk
    else:
        fqns = [i.fqn for i in extents]
        chunks = [None if i.offset is None else list(i.offset) for i in extents]
    text = "\x00".join(fqns) + "\x01" + repr(chunks)
    return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))


__all__ = ["MEMO_ATTRIBUTE", "RecordMemo", "encode_columnar", "record_memo"]
