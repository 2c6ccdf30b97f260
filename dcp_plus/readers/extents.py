"""Checked reads of extents: bounds, checksum compare, aligned destination buffers, how an
extent is named in messages."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.checksum import (
    ALGORITHM,
    BOUND_ALGORITHM,
    bind_checksum,
    checksum_bytes,
)
from dcp_plus.format.record import Extent
from dcp_plus.storage.direct_read import DIRECT_ALIGN


def check_extent_bounds(extents: Iterable[tuple[str, Extent]],
                        size_of: Callable[[str], int | None],
                        location: Callable[[str], str]) -> None:
    """Every extent must lie inside its data file or object (``size_of`` is None if missing).

    Raises:
        CheckpointFormatError: naming the field, the file and the tensor.
    """
    sizes: dict[str, int | None] = {}
    for i, (what, e) in enumerate(extents):
        if e.file not in sizes:
            sizes[e.file] = size_of(e.file)
        size = sizes[e.file]
        if size is None:
            raise CheckpointFormatError(
                f"{location(e.file)}: data file of {what} (extents[{i}].file) is missing"
            )
        if e.length and e.offset + e.length > size:
            raise CheckpointFormatError(
                f"{location(e.file)}: extents[{i}] of {what} (offset {e.offset}, "
                f"length {e.length}) runs past the end of the file ({size} bytes): "
                "the file is truncated or the record is corrupt"
            )


def verify_checksum(data: memoryview, ext: Extent, what: str, root: str,
                    identity: str) -> None:
    """Raise CorruptCheckpointError naming the file and item when ``data`` does not match
    (``identity``: the extent's, which version-2 checksums are bound to)."""
    check_digest(checksum_bytes(data), ext, what, root, identity)


def digest_matches(actual: str, ext: Extent, identity: str) -> bool:
    """Whether the content checksum ``actual`` is the one ``ext`` records (bound to
    ``identity`` for version-2 checksums).

    Raises:
        CheckpointFormatError: the record names an unsupported checksum algorithm.
    """
    algorithm = ext.checksum.split(":", 1)[0]
    if algorithm == BOUND_ALGORITHM:
        return bind_checksum(actual, identity) == ext.checksum
    if algorithm == ALGORITHM:
        return actual == ext.checksum
    raise CheckpointFormatError(f"unsupported checksum {ext.checksum!r}")


def check_digest(actual: str, ext: Extent, what: str, root: str, identity: str) -> None:
    """:func:`verify_checksum` given the content checksum of the extent's bytes."""
    try:
        ok = digest_matches(actual, ext, identity)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{os.path.join(root, ext.file)}: {what}: {e}") from None
    if not ok:
        raise CorruptCheckpointError(
            f"{os.path.join(root, ext.file)}: checksum mismatch in {what} (bytes "
            f"{ext.offset}..{ext.offset + ext.length}): the stored bytes do not match what the "
            "record says this extent holds; the data file is corrupt (or the record entry "
            "was moved, or its dtype or lengths edited)"
        )


def aligned_bytes(n: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``n`` bytes starting 4 KiB-aligned in memory, so
    that O_DIRECT reads can fill it without a bounce buffer."""
    raw = torch.empty(n + DIRECT_ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % DIRECT_ALIGN
    return raw[start : start + n]


def describe(index: MetadataIndex) -> str:
    chunk = "" if index.offset is None or not any(index.offset) else f" chunk {list(index.offset)}"
    return f"tensor {index.fqn!r}{chunk}"


def batches_by_file(indexes: Iterable[MetadataIndex], extent: Callable[[MetadataIndex], Extent],
                    limit: int) -> list[tuple[str, list[MetadataIndex]]]:
    """``indexes`` by data file in offset order, cut into batches of about ``limit`` bytes
    (a batch ends with the extent that reaches it)."""
    per_file: dict[str, list[MetadataIndex]] = defaultdict(list)
    for i in indexes:
        per_file[extent(i).file].append(i)
    batches = []
    for name, idxs in per_file.items():
        idxs.sort(key=lambda i: extent(i).offset)
        batch: list[MetadataIndex] = []
        size = 0
        for i in idxs:
            batch.append(i)
            size += extent(i).length
            if size >= limit:
                batches.append((name, batch))
                batch, size = [], 0
        if batch:
            batches.append((name, batch))
    return batches
