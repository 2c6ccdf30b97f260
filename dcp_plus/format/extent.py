"""An extent: where one stored item's bytes live, and what identifies them."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torch.distributed.checkpoint.metadata import MetadataIndex

if TYPE_CHECKING:
    from dcp_plus.format.parts import Part

BYTESIO = "bytesio"
"""``Extent.value`` of an ``io.BytesIO`` state-dict value stored as its raw bytes."""


class Extent(NamedTuple):
    """Where one stored item lives: ``length`` stored bytes at ``offset`` of ``file``.

    A named tuple, not a dataclass: a record of 100,000 tensors builds as many, and a tuple
    is built in a third of the time.

    ``value`` says how a non-tensor item's bytes are read back: ``None`` for
    ``torch.save`` bytes (loaded with ``weights_only=True``), :data:`BYTESIO` for the raw
    contents of an ``io.BytesIO``.

    Incremental checkpoints add two fields. ``parts`` (codec ``"chunked"``): the extent is
    stored as :class:`~dcp_plus.format.parts.Part` pieces, some in this checkpoint (within
    ``file`` at ``offset``, ``length`` bytes covering them), some referenced in sibling
    checkpoints; its checksum binds the parts' table. ``base``: the whole extent is the one
    the sibling checkpoint of that name recorded (every other field is as that record has
    it, and its own parts are that checkpoint's).
    """

    file: str
    offset: int
    length: int
    raw_length: int
    codec: str
    checksum: str
    value: str | None = None
    prefix: str | None = None
    base: str | None = None
    parts: tuple[Part, ...] | None = None


def identity_of(fqn: str, chunk: tuple[int, ...] | list[int] | None, dtype_name: str | None,
                raw_length: int, length: int, codec: str, value: str | None) -> str:
    """What an extent holds, as the text its version-2 checksum is bound to: the item, the
    chunk's offsets, the dtype (``None`` for bytes), the lengths, the codec, the value kind."""
    where = "-" if chunk is None else ",".join(map(str, chunk))
    return f"{fqn}\x00{where}\x00{dtype_name or 'bytes'}\x00{raw_length}\x00{length}\x00{codec}" \
           f"\x00{value or ''}"


def extent_identity(index: MetadataIndex, dtype_name: str | None, ext: Extent) -> str:
    """:func:`identity_of` the extent ``ext`` of item ``index``."""
    return identity_of(index.fqn, index.offset, dtype_name, ext.raw_length, ext.length,
                       ext.codec, ext.value)
