"""The memory tier's tensor checksum, computable piece by piece.

A tensor's bytes are cut into pieces of :data:`PIECE_BYTES`; its checksum is the xxh3-64 of its
bytes when they fit in one piece, else the xxh3-64 of its pieces' xxh3-64 digests (8 bytes
each, big-endian). The pieces can then be hashed apart, each in the same pass as its copy: the
stager's copy lanes cut large tensors at the same boundaries and run in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

PIECE_BYTES = 16 << 20
EMPTY = xxhash.xxh3_64_hexdigest(b"")


def combine(pieces: Sequence[int]) -> str:
    """The checksum (hex) of a tensor whose pieces, in order, have the xxh3-64 ``pieces``."""
    if not pieces:
        return EMPTY
    if len(pieces) == 1:
        return f"{pieces[0]:016x}"
    return xxhash.xxh3_64_hexdigest(b"".join(p.to_bytes(8, "big") for p in pieces))


class PieceHasher:
    """The checksum of bytes fed in order, in chunks of any size."""

    __slots__ = ("_filled", "_hasher", "_pieces")

    def __init__(self) -> None:
        self._pieces: list[int] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            n = min(len(data), PIECE_BYTES - self._filled)
            self._hasher.update(data[:n])
            self._filled += n
            data = data[n:]
            if self._filled == PIECE_BYTES:
                self._pieces.append(self._hasher.intdigest())
                self._hasher.reset()
                self._filled = 0

    def hexdigest(self) -> str:
        tail = [self._hasher.intdigest()] if self._filled else []
        return combine(self._pieces + tail)


def digest_of(data: memoryview) -> str:
    """The checksum of ``data`` whole."""
    if len(data) <= PIECE_BYTES:
        return xxhash.xxh3_64_hexdigest(data)
    return combine([xxhash.xxh3_64_intdigest(data[i:i + PIECE_BYTES])
                    for i in range(0, len(data), PIECE_BYTES)])
