"""``dcp-plus diff A B``: what differs between two checkpoints, from their records alone.

Content is compared through the extents' checksums: a version-2 checksum is bound to the
extent's identity (name, chunk, dtype, lengths, codec), so two extents with equal checksums
hold equal bytes, and differing ones differ (in content, or in how they are stored).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dcp_plus.format.record import Extent, dtype_name
from dcp_plus.readers.inspect import load_record
from dcp_plus.storage.urls import is_url


def _items(md: Metadata) -> dict[str, dict[str, Any]]:
    sums: dict[str, list[tuple[Any, str]]] = defaultdict(list)
    sizes: dict[str, int] = defaultdict(int)
    for index, ext in cast(dict[MetadataIndex, Extent], md.storage_data).items():
        sums[index.fqn].append((tuple(index.offset or ()), ext.checksum))
        sizes[index.fqn] += ext.raw_length
    out = {}
    for fqn, item in md.state_dict_metadata.items():
        tensor = item if isinstance(item, TensorStorageMetadata) else None
        out[fqn] = {"dtype": dtype_name(tensor.properties.dtype) if tensor else None,
                    "shape": list(tensor.size) if tensor else None, "bytes": sizes[fqn],
                    "checksums": sorted(sums[fqn])}
    return out


def diff_checkpoints(a: str, b: str, storage_options: Mapping[str, Any] | None = None,
                     ) -> dict[str, Any]:
    """``added`` / ``removed`` names, ``changed`` rows (name and what changed: dtype, shape,
    bytes, content) and the count of ``same`` items, from ``a`` to ``b`` (local paths or URLs;
    ``storage_options`` for the URLs)."""
    left = _items(load_record(a, storage_options if is_url(a) else None))
    right = _items(load_record(b, storage_options if is_url(b) else None))
    changed = []
    for name in sorted(left.keys() & right.keys()):
        x, y = left[name], right[name]
        what = [k for k in ("dtype", "shape", "bytes") if x[k] != y[k]]
        if not what and x["checksums"] != y["checksums"]:
            what = ["content"]
        if what:
            changed.append({"name": name, "changed": what,
                            "a": {k: x[k] for k in ("dtype", "shape", "bytes")},
                            "b": {k: y[k] for k in ("dtype", "shape", "bytes")}})
    same = len(left.keys() & right.keys()) - len(changed)
    return {"a": a, "b": b, "added": sorted(right.keys() - left.keys()),
            "removed": sorted(left.keys() - right.keys()), "changed": changed, "same": same}
