"""An extent: where one stored item's bytes live, and what identifies them."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex

BYTESIO = "bytesio"
"""``Extent.value`` of an ``io.BytesIO`` state-dict value stored as its raw bytes."""


@dataclass(frozen=True)
class Extent:
    """Where one stored item lives: ``length`` stored bytes at ``offset`` of ``file``.

    ``value`` says how a non-tensor item's bytes are read back: ``None`` for
    ``torch.save`` bytes (loaded with ``weights_only=True``), :data:`BYTESIO` for the raw
    contents of an ``io.BytesIO``.
    """

    file: str
    offset: int
    length: int
    raw_length: int
    codec: str
    checksum: str
    value: str | None = None


def extent_identity(index: MetadataIndex, dtype_name: str | None, ext: Extent) -> str:
    """What an extent holds, as the text its version-2 checksum is bound to: the item, the
    chunk's offsets, the dtype (``None`` for bytes), the lengths, the codec, the value kind."""
    chunk = "-" if index.offset is None else ",".join(map(str, index.offset))
    return "\x00".join((index.fqn, chunk, dtype_name or "bytes", str(ext.raw_length),
                        str(ext.length), ext.codec, ext.value or ""))
