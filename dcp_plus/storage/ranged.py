"""Ranged reads and multipart arithmetic shared by the object stores.

An object to upload is ``segments``: ``(offset, bytes)`` pairs, zero-filled between
(:func:`assemble` cuts it into :func:`part_bounds` parts). Whole extents are read by
:func:`plan_requests`' coalesced ranged requests, :class:`ExtentFill` keeping track of
which extents are complete.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.layout import MAX_RECORD_BYTES
from dcp_plus.storage.retry import RetryPolicy

Segments = Sequence[tuple[int, memoryview]]
MIN_PART_SIZE = 5 << 20  # S3's smallest part (but the last)
MAX_PARTS = 10_000


@dataclass(frozen=True)
class StoreConfig:
    """Transfer tuning shared by writers and readers.

    Attributes:
        part_size: bytes per multipart-upload part (>= 5 MiB on S3).
        concurrency: requests in flight per process.
        retry: backoff policy for throttling, 5xx and connection failures.
        coalesce_gap: ranged reads of extents at most this far apart are merged.
        range_size: the largest single ranged GET; longer runs are split and read in parallel.
    """

    part_size: int = 32 << 20
    concurrency: int = 8
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    coalesce_gap: int = 1 << 20
    range_size: int = 32 << 20

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.part_size < 1 or self.range_size < 1 or self.coalesce_gap < 0:
            raise ValueError(f"invalid transfer sizes: {self}")


_ZEROS = memoryview(bytes(1 << 16))


def check_small(location: str, size: int) -> None:
    """Refuse to read ``location`` whole (``ObjectStore.get``) when it is over the bound."""
    if size > MAX_RECORD_BYTES:
        raise CheckpointFormatError(f"{location}: {size} bytes, more than a commit record or "
                                    f"extent table may hold ({MAX_RECORD_BYTES}); not read")


class ReadsByExtents:
    """``read`` for a store that has ``read_extents`` (an ``ExtentStore``)."""

    def read_extents(self, extents: Sequence[tuple[str, int, int]],
                     open_extent: Callable[[int], memoryview], done: Callable[[int], None],
                     executor: Executor | None = None) -> None:
        raise NotImplementedError

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, buffer)`` from object ``name``."""
        self.read_extents([(name, off, len(v)) for off, v in reads],
                          lambda k: reads[k][1], lambda k: None)


def assemble(segments: Segments, starts: Sequence[int], start: int, end: int) -> bytes:
    """The object bytes ``[start, end)``: segment data, zeros between (``starts`` is sorted).

    One copy, straight into a new ``bytes``: no zero-filled buffer first, and HTTP clients
    send ``bytes`` without copying them again (aiohttp slices a ``bytearray`` body).
    """
    pieces: list[memoryview] = []
    pos = start
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(segments) and segments[i][0] < end:
        off, data = segments[i]
        a, b = max(off, pos), min(off + len(data), end)
        if a < b:
            _zeros(pieces, a - pos)
            pieces.append(data[a - off : b - off])
            pos = b
        i += 1
    _zeros(pieces, end - pos)
    return b"".join(pieces)


def _zeros(pieces: list[memoryview], n: int) -> None:
    while n > 0:
        take = min(n, len(_ZEROS))
        pieces.append(_ZEROS[:take])
        n -= take


def part_bounds(total: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each multipart part (grown so that at most 10,000 are needed)."""
    size = max(part_size, math.ceil(total / MAX_PARTS))
    return [(a, min(a + size, total)) for a in range(0, total, size)]


@dataclass
class RangeRequest:
    """One ranged GET: ``pieces`` fill ``[start, start + length)`` in order.

    A piece ``(k, lo, hi)`` is bytes ``[lo, hi)`` of extent ``k``; ``k == -1`` is a gap
    between coalesced extents (read into scratch and dropped).
    """

    name: str
    start: int
    pieces: list[tuple[int, int, int]]

    @property
    def length(self) -> int:
        return sum(hi - lo for _, lo, hi in self.pieces)


def plan_requests(extents: Sequence[tuple[str, int, int]], gap: int,
                  max_len: int) -> list[RangeRequest]:
    """Ranged requests that read extents ``(object name, offset, length)``; ``k`` of a piece
    is an index into ``extents``. Objects come in order of first appearance, each in
    ascending offsets; empty extents get no piece.

    Neighbours at most ``gap`` bytes apart share a request; runs are cut at the multiples of
    ``max_len`` (object offsets), so no request is longer than ``max_len`` and none
    straddles a ``max_len`` boundary: with ``max_len`` a multiple or a divisor of the
    writer's part size, a request covers whole uploaded parts or lies inside one, never the
    tail of one part and the head of the next (which costs SeaweedFS partial reads of two
    chunks: 10-20 % more server CPU per load on the dev VM).
    """
    by_name: dict[str, list[int]] = {}
    for k, (name, _, length) in enumerate(extents):
        if length:
            by_name.setdefault(name, []).append(k)
    out: list[RangeRequest] = []
    for name, ks in by_name.items():
        ks.sort(key=lambda k: extents[k][1])
        # runs of coalesced extents: (start, pieces)
        runs: list[tuple[int, list[tuple[int, int, int]]]] = []
        end = -1
        for k in ks:
            off, length = extents[k][1], extents[k][2]
            if runs and end <= off <= end + gap:
                if off > end:
                    runs[-1][1].append((-1, 0, off - end))
                runs[-1][1].append((k, 0, length))
            else:
                runs.append((off, [(k, 0, length)]))
            end = off + length
        for start, pieces in runs:
            cur: list[tuple[int, int, int]] = []
            cur_start = pos = start
            limit = (start // max_len + 1) * max_len  # where the current request must end
            for k, lo, hi in pieces:
                while lo < hi:
                    take = min(hi - lo, limit - pos)
                    cur.append((k, lo, lo + take))
                    lo += take
                    pos += take
                    if pos == limit:
                        out.append(RangeRequest(name, cur_start, cur))
                        cur_start, cur, limit = pos, [], pos + max_len
            if cur:
                out.append(RangeRequest(name, cur_start, cur))
    return out


class ExtentFill:
    """Bookkeeping of one read of whole extents by :func:`plan_requests`' requests.

    :meth:`views` (called by one thread, in request order) opens an extent's buffer
    (``open_extent(k)``) when the first request that touches it is about to start, so
    buffers exist only from then on; :meth:`finished` (any thread) returns the extents whose
    last request has just completed.
    """

    def __init__(self, requests: Sequence[RangeRequest],
                 open_extent: Callable[[int], memoryview]) -> None:
        self._open = open_extent
        self._buffers: dict[int, memoryview] = {}
        self._pending: dict[int, int] = {}
        for req in requests:
            for k, _, _ in req.pieces:
                if k >= 0:
                    self._pending[k] = self._pending.get(k, 0) + 1
        self._lock = threading.Lock()

    def views(self, req: RangeRequest) -> list[memoryview]:
        out = []
        for k, lo, hi in req.pieces:
            if k < 0:
                out.append(memoryview(bytearray(hi - lo)))
                continue
            with self._lock:
                buf = self._buffers.get(k)
            if buf is None:  # the first request of extent k: no other thread knows it yet
                buf = self._open(k)
                with self._lock:
                    self._buffers[k] = buf
            out.append(buf[lo:hi])
        return out

    def finished(self, req: RangeRequest) -> list[int]:
        done = []
        with self._lock:
            for k, _, _ in req.pieces:
                if k >= 0:
                    self._pending[k] -= 1
                    if self._pending[k] == 0:
                        done.append(k)
                        del self._buffers[k]
        return done


def fill(views: list[memoryview], data: bytes | memoryview, what: str) -> None:
    """Copy ``data`` into consecutive ``views``; a short ``data`` raises EOFError."""
    need = sum(len(v) for v in views)
    if len(data) < need:
        raise EOFError(f"{what}: object ends {need - len(data)} bytes early")
    pos = 0
    for v in views:
        v[:] = data[pos : pos + len(v)]
        pos += len(v)
