"""Copying a snapshot's tensors into a state dict with their checksums checked in the same
pass, whatever the bytes come from (:data:`~dcp_plus.tiers.shm_files.Fill`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError
from dcp_plus.format.piece_digest import PieceHasher
from dcp_plus.format.values import byte_view
from dcp_plus.tiers.flat import Flat
from dcp_plus.tiers.record import DTYPES, TensorEntry, TierRecord
from dcp_plus.tiers.shm_files import Fill
from dcp_plus.tiers.values import decode_values

CHUNK = 1 << 20  # copy and hash in pieces that stay in (L2) cache between the two


def check_layout(entry: TensorEntry, dest: torch.Tensor, source: str) -> None:
    """Raise ``CheckpointFormatError`` unless ``dest`` has ``entry``'s dtype and shape."""
    if dest.dtype != DTYPES[entry.dtype] or list(dest.shape) != entry.shape:
        raise CheckpointFormatError(
            f"{source}: tensor {entry.fqn!r} is {entry.dtype}{entry.shape} in the snapshot "
            f"but {str(dest.dtype).removeprefix('torch.')}{list(dest.shape)} here")


def lands_in_place(entry: TensorEntry, dest: torch.Tensor) -> bool:
    """Whether ``entry``'s bytes can be written straight into ``dest``'s memory."""
    return entry.nbytes > 0 and dest.dtype == DTYPES[entry.dtype] and \
        list(dest.shape) == entry.shape and dest.is_contiguous() and \
        dest.device.type == "cpu" and entry.stride == list(dest.stride())


def check_digest(digest: str, entry: TensorEntry, source: str) -> None:
    if digest != entry.checksum:
        raise CorruptCheckpointError(
            f"{source}: tensor {entry.fqn!r} does not match its checksum in shared memory")


def copy_verified(fill: Fill, dest: torch.Tensor, entry: TensorEntry, source: str) -> None:
    """Copy ``entry``'s bytes (from ``fill``) into ``dest``, checking their checksum in the
    same pass (chunk by chunk while the chunk is in cache, when ``dest`` is contiguous)."""
    check_layout(entry, dest, source)
    h = PieceHasher()
    if entry.nbytes == 0:
        pass
    elif lands_in_place(entry, dest):
        out = byte_view(dest)
        for i in range(0, entry.nbytes, CHUNK):
            piece = out[i:i + CHUNK]
            fill(piece, i)
            h.update(piece)
    else:
        bounce = torch.empty(entry.nbytes, dtype=torch.uint8)
        fill(byte_view(bounce), 0)
        h.update(byte_view(bounce))
        typed = bounce.view(DTYPES[entry.dtype]).as_strided(entry.shape, entry.stride)
        with torch.no_grad():
            dest.copy_(typed)
    check_digest(h.hexdigest(), entry, source)


def destinations(record: TierRecord, flat: Flat, source: str) -> list[torch.Tensor]:
    """``flat``'s tensor for each of ``record``'s entries; raises ``CheckpointFormatError``
    when the structures differ."""
    if record.fingerprint != flat.fingerprint:
        raise CheckpointFormatError(
            f"{source}: the snapshot's structure (fingerprint {record.fingerprint}) is not "
            f"this state dict's ({flat.fingerprint})")
    out = []
    for e in record.entries:
        dest = flat.tensors.get(e.fqn)
        if dest is None:
            raise CheckpointFormatError(f"{source}: tensor {e.fqn!r} is not in the state dict")
        out.append(dest)
    return out


def restore_into(record: TierRecord, flat: Flat, source: str,
                 fill_for: Callable[[TensorEntry], Fill]) -> dict[str, Any]:
    """Copy ``record``'s tensors into ``flat``'s (verified); returns its non-tensor values.

    ``fill_for(entry)`` gives the :data:`Fill` of an entry's bytes.
    """
    for e, dest in zip(record.entries, destinations(record, flat, source), strict=True):
        copy_verified(fill_for(e), dest, e, source)
    return decode_values(record.values_bytes())
