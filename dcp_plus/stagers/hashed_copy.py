"""Copies that checksum what they copy (a memory-tier snapshot): each piece of a tensor (see
:mod:`dcp_plus.format.piece_digest`) is copied and hashed in steps small enough to stay in (L2)
cache between the two, so the checksum costs no second pass over memory. Both the copy
(:func:`~dcp_plus.storage.direct_read.copy_bytes`) and xxh3 release the GIL, as
``_foreach_copy_`` does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from dcp_plus.format.piece_digest import PIECE_BYTES, combine
from dcp_plus.format.values import byte_view
from dcp_plus.storage.direct_read import copy_bytes

STEP = 512 << 10
"""Bytes copied, then hashed, at a time: fits L2 with the source's bytes beside it."""

Key = tuple[int, int]
"""A destination tensor by its ``(data_ptr, nbytes)``."""


@dataclass(slots=True)
class Piece:
    """Bytes ``[src, src + nbytes)`` to copy to ``dst`` (addresses); ``view`` is the
    destination's bytes, hashed after the copy; the ``index``-th piece of ``key``."""

    key: Key
    index: int
    src: int
    dst: int
    nbytes: int
    view: memoryview


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def pieces_of(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
              ) -> tuple[list[Piece], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pieces of every ``(source, destination)`` pair that is a plain byte copy
    (contiguous CPU tensors of one dtype and shape), and the other pairs."""
    pieces: list[Piece] = []
    rest = []
    for s, d in pairs:
        n = d.nbytes
        if not (n and s.dtype == d.dtype and s.shape == d.shape and _plain(s) and _plain(d)):
            rest.append((s, d))
            continue
        key, view, src = (d.data_ptr(), n), byte_view(d), s.data_ptr()
        for i, at in enumerate(range(0, n, PIECE_BYTES)):
            m = min(PIECE_BYTES, n - at)
            pieces.append(Piece(key, i, src + at, key[0] + at, m, view[at:at + m]))
    return pieces, rest


def split_pieces(pieces: Sequence[Piece], lanes: int) -> list[list[Piece]]:
    """``pieces`` in ``lanes`` runs of about equal bytes, order kept."""
    total = sum(p.nbytes for p in pieces) or 1
    out: list[list[Piece]] = [[] for _ in range(lanes)]
    done = 0
    for p in pieces:
        out[min(lanes - 1, done * lanes // total)].append(p)
        done += p.nbytes
    return out


def copy_hashed(run: Sequence[Piece]) -> list[tuple[Key, int, int]]:
    """Copy every piece of ``run``; returns ``(key, index, xxh3-64)`` for each."""
    out = []
    for p in run:
        if p.nbytes <= STEP:
            copy_bytes(p.dst, p.src, p.nbytes)
            out.append((p.key, p.index, xxhash.xxh3_64_intdigest(p.view)))
            continue
        h = xxhash.xxh3_64()
        for at in range(0, p.nbytes, STEP):
            n = min(STEP, p.nbytes - at)
            copy_bytes(p.dst + at, p.src + at, n)
            h.update(p.view[at:at + n])
        out.append((p.key, p.index, h.intdigest()))
    return out


def digests(runs: Iterable[list[tuple[Key, int, int]]]) -> dict[Key, str]:
    """Each destination's checksum from what :func:`copy_hashed` returned for its pieces."""
    by_key: dict[Key, dict[int, int]] = {}  # a destination copied twice counts once
    for run in runs:
        for key, index, digest in run:
            by_key.setdefault(key, {})[index] = digest
    return {k: combine([v[i] for i in sorted(v)]) for k, v in by_key.items()}
