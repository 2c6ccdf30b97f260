"""Cutting an extent into parts and deciding what each stores: nothing (equal to the base's
part), its bytes (the tensor's codec), or an XOR delta against the old bytes still in memory.

Torch-free: the writer worker processes run it on slab views, the saving process on other
tensors' bytes. Every part's bytes are hashed once, here, right before they are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dcp_plus.format.codecs import get_codec
from dcp_plus.format.delta import encode_delta
from dcp_plus.format.layout import ALIGNMENT, align_up
from dcp_plus.format.parts import DELTA_CODEC, MAX_PART_BYTES, part_hash

DEFAULT_PART_BYTES = 1 << 20
"""Part size of incremental checkpoints: small enough that a frozen block inside a tensor, or
an untouched slice of an embedding table, is found; large enough that a record of a 2 GiB
state lists ~2,000 parts."""


def part_bytes_problem(value: object) -> str | None:
    """Why ``value`` cannot be a part size, or None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < ALIGNMENT or \
            value % ALIGNMENT or value > MAX_PART_BYTES:
        return (f"must be a multiple of {ALIGNMENT} bytes from {ALIGNMENT} to "
                f"{MAX_PART_BYTES}, got {value!r}")
    return None


@dataclass(frozen=True)
class ChunkSpec:
    """How one extent is cut and compared.

    Attributes:
        part_bytes: raw bytes per part (the last one fewer); a multiple of 4 KiB.
        base: the hash of each of the base checkpoint's parts of this extent, cut the same
            way (None: nothing to compare with; every part is stored).
        codec: how a changed part is stored (``identity``, ``zstd``, ``zstd+shuffle``).
        itemsize: the tensor's element size (byte planes of the shuffle).
        old: ``(slab, offset)`` of the extent's bytes as the base stored them, still in
            shared memory (the previous snapshot); changed parts are then stored as XOR
            deltas against them where that is smaller, after the old bytes are checked
            against the base's hash (a snapshot overwritten meanwhile is simply not used).
    """

    part_bytes: int
    base: tuple[str, ...] | None = None
    codec: str = "identity"
    itemsize: int = 1
    old: tuple[str, int] | None = None


class Piece(NamedTuple):
    """What one part of ``raw`` bytes stores: ``codec`` None when it equals the base's part
    (``data`` None)."""

    hash: str
    codec: str | None
    data: memoryview | bytes | None
    raw: int


Outcome = tuple[str, str | None, int, int]
"""``(hash, codec, offset, length)`` of one part as written (codec None: the base's part)."""


def part_bounds(raw_length: int, part_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each part of an extent of ``raw_length`` bytes."""
    return [(a, min(a + part_bytes, raw_length)) for a in range(0, raw_length, part_bytes)]


def encode_pieces(raw: memoryview, spec: ChunkSpec, old: memoryview | None = None
                  ) -> list[Piece]:
    """The pieces of ``raw`` under ``spec`` (``old``: the bytes at ``spec.old``)."""
    bounds = part_bounds(len(raw), spec.part_bytes)
    base = spec.base if spec.base is not None and len(spec.base) == len(bounds) else None
    codec = None if spec.codec == "identity" else get_codec(spec.codec)
    out = []
    for k, (a, b) in enumerate(bounds):
        new = raw[a:b]
        h = part_hash(new)
        if base is not None and base[k] == h:
            out.append(Piece(h, None, None, b - a))
            continue
        stored: memoryview | bytes = new if codec is None else codec.encode(new, spec.itemsize)
        name = spec.codec
        if base is not None and old is not None and len(old) == len(raw):
            delta = _delta(new, old[a:b], base[k], spec.itemsize)
            if delta is not None and len(delta) < len(stored):
                stored, name = delta, DELTA_CODEC
        out.append(Piece(h, name, stored, b - a))
    return out


def _delta(new: memoryview, old: memoryview, old_hash: str, itemsize: int) -> bytes | None:
    # the old bytes are copied first and checked on the copy: a snapshot being overwritten
    # (its buffer reused by the next one) fails the check instead of yielding a torn delta
    copy = bytes(old)
    if part_hash(copy) != old_hash:
        return None
    return encode_delta(new, copy, itemsize)


def pack(pieces: list[list[Piece]], start: int = 0) -> tuple[list[list[Outcome]], int]:
    """Offsets for the stored pieces of several extents, one after the other: raw views
    4 KiB-aligned (slab views are written with O_DIRECT straight from the slab), encoded
    pieces packed tight (written from their own buffers, so alignment would only add
    padding to every small delta); the outcomes and the file's size."""
    cursor = start
    end = start
    out = []
    for extent in pieces:
        rows: list[Outcome] = []
        for p in extent:
            if p.data is None:
                rows.append((p.hash, None, 0, 0))
                continue
            if isinstance(p.data, memoryview):
                cursor = align_up(cursor, ALIGNMENT)
            rows.append((p.hash, p.codec, cursor, len(p.data)))
            cursor += len(p.data)
            end = cursor
        out.append(rows)
    return out, end


def segments(pieces: list[list[Piece]], outcomes: list[list[Outcome]],
             raws: list[memoryview]) -> list[tuple[int, memoryview | bytes]]:
    """``(offset, bytes)`` of every stored piece; raw pieces that follow one another both in
    their extent ``raws[i]`` and in the file become one segment (one large write)."""
    out: list[tuple[int, memoryview | bytes]] = []
    for ps, rows, raw in zip(pieces, outcomes, raws, strict=True):
        run: list[int] | None = None  # [file offset, start in raw, end in raw]
        at = 0
        for p, (_, _, off, _) in zip(ps, rows, strict=True):
            if isinstance(p.data, memoryview):
                if run is not None and run[0] + run[2] - run[1] == off and run[2] == at:
                    run[2] += p.raw
                else:
                    if run is not None:
                        out.append((run[0], raw[run[1] : run[2]]))
                    run = [off, at, at + p.raw]
            elif p.data is not None:
                out.append((off, p.data))
            at += p.raw
        if run is not None:
            out.append((run[0], raw[run[1] : run[2]]))
    return out
