"""Where the bytes of one ``O_DIRECT`` read request land (torch-free).

``O_DIRECT`` needs the file offset and the memory address of every byte run aligned to the
same 4 KiB, but a destination tensor rarely starts 4 KiB-aligned (torch's large CPU tensors
start 64 bytes into a page) while dcp_plus extents do in their files. A piece of at least
:data:`MIN_IN_PLACE` bytes is read *in place*: its aligned body goes into its own
destination at the first 4 KiB boundary, ``shift`` (< 4 KiB) bytes past its start, and is
moved down into place afterwards; the rest of the piece (< 8 KiB) and everything else the
request spans (small pieces, gaps, the rounding at either end) go into a small side buffer.
The body ends ``shift`` bytes or more before the piece does, so a read in place writes only
the piece's own destination bytes: pieces never disturb each other. One ``preadv`` fills all
of it; no request needs a bounce buffer of its own length, and a process's first load faults
in no fresh memory for one (~1.2 ms a MiB on the dev VM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dcp_plus.storage.direct_read import DIRECT_ALIGN, address

MIN_IN_PLACE = 64 << 10
"""The smallest piece read in place: smaller ones go through the side buffer."""

MayShift = Callable[[int, int], bool]
"""``may_shift(start, end)``: whether destination addresses ``[start, end)`` belong to one
tensor alone, so that a read may pass shifted bytes through them (tied weights share their
memory: a second read landing there meanwhile would be moved down with the first's)."""


@dataclass
class Landing:
    """Piece ``(k, lo, hi)`` of a request and where its bytes land: with ``shift >= 0`` its
    first ``body`` bytes at ``view[shift:shift + body]``, its last ``hi - lo - body`` at
    ``side_at`` in the side buffer; with ``shift == -1`` all of them at ``side_at``."""

    k: int
    lo: int
    hi: int
    view: memoryview | None
    shift: int = -1
    body: int = 0
    side_at: int = 0


@dataclass
class RequestLayout:
    """The landings of a request's pieces and the ``preadv`` segments, in file order from
    ``start`` (the request's first byte rounded down to 4 KiB): ``(landing, at, length)``
    is ``length`` bytes into landing ``landing``'s view from ``at``, or with ``landing ==
    -1`` into the side buffer from ``at``."""

    start: int
    landings: list[Landing]
    segments: list[tuple[int, int, int]]
    side_bytes: int


def lay_out(start: int, length: int, pieces: Sequence[tuple[int, int, int]],
            views: Sequence[memoryview | None], may_shift: MayShift | None) -> RequestLayout:
    """The layout of a request for bytes ``[start, start + length)`` of a file made of
    ``pieces`` (``(k, lo, hi)``, ``k == -1`` a gap) landing in ``views`` (None: dropped).
    A piece is read in place when its file offset is 4 KiB-aligned, it is at least
    :data:`MIN_IN_PLACE` long, and its destination either is aligned too (nothing to move)
    or ``may_shift`` allows it."""
    a = start - start % DIRECT_ALIGN
    b = -(-(start + length) // DIRECT_ALIGN) * DIRECT_ALIGN
    run, side = a, 0  # the side run under way: its file offset and its side-buffer offset
    landings: list[Landing] = []
    segments: list[tuple[int, int, int]] = []
    at = start
    for (k, lo, hi), view in zip(pieces, views, strict=True):
        n = hi - lo
        landing = Landing(k, lo, hi, view)
        if view is not None and n >= MIN_IN_PLACE and at % DIRECT_ALIGN == 0:
            where = address(view)
            shift = -where % DIRECT_ALIGN
            if shift == 0 or (may_shift is not None and may_shift(where, where + n)):
                landing.shift = shift
                landing.body = (n - shift) // DIRECT_ALIGN * DIRECT_ALIGN
        if landing.shift >= 0:
            if at > run:
                segments.append((-1, side, at - run))
                side += at - run
            segments.append((len(landings), landing.shift, landing.body))
            run = at + landing.body
            landing.side_at = side
        else:
            landing.side_at = side + at - run
        landings.append(landing)
        at += n
    if b > run:
        segments.append((-1, side, b - run))
        side += b - run
    return RequestLayout(a, landings, segments, side)
