"""Whole extents read with ``O_DIRECT`` by a few threads, each hashed as its bytes land.

Requests are :func:`~dcp_plus.storage.ranged.plan_requests`' (neighbours coalesced, whatever their size,
runs cut at multiples of :data:`PIECE`, so a request starts where an extent or a multiple of
``PIECE`` does: 4 KiB-aligned in dcp_plus files). Each request is one ``preadv``: pieces of
64 KiB or more straight into their destinations (:mod:`~dcp_plus.storage.direct_landing`:
shifted to the next 4 KiB boundary and moved down after, unless the destination is aligned
already), the rest into a small side buffer and copied out; a request with no piece read in
place goes whole into a bounce buffer. Each extent's bytes are hashed in file order as they
land (:data:`HASH_STEP` at a time, right after each move or copy, while in the CPU cache): the
checksum needs no second pass over the data.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from dcp_plus.format.checksum import Hasher, format_checksum, new_hasher
from dcp_plus.storage.buffers import BufferPool, aligned_buffer
from dcp_plus.storage.direct_landing import Landing, MayShift, lay_out
from dcp_plus.storage.direct_read import (
    DIRECT_ALIGN,
    address,
    copy_bytes,
    is_refusal,
    preadv_upto,
    set_direct,
)
from dcp_plus.storage.fanout import windowed
from dcp_plus.storage.fileio import read_coalesced
from dcp_plus.storage.ranged import RangeRequest, plan_requests

PIECE = 16 << 20
"""The longest request: 4 streams of 16 MiB (16 device requests of 4 MiB in flight) reach the
device's O_DIRECT read rate on the dev VM. 8 MiB would halve the bounce memory a process's
first load faults in (~1.2 ms a MiB there) but reads slower: 8 GiB verified loads, warm,
1.155x the read limit with 8 MiB, 1.038x with 16, 1.098x with 32 (3 rounds each)."""
HASH_STEP = 1 << 20
MANY_EXTENTS = 64
"""Requests of this many extents or more are read early (see :func:`_order`)."""
COPIERS = 2
"""Requests beyond ``streams`` under way at once: copying out and hashing what they read while
``streams`` others read. Without them the streams' reads, issued together, end together and
all wait on their copies (~5 ms in every ~31 ms round of 4 x 16 MiB here, with nothing in
flight at the device)."""
GAP = 64 << 10
"""Extents at most this far apart are read by one request (the gap into the bounce buffer)."""
assert PIECE % DIRECT_ALIGN == 0, "requests are cut at multiples of PIECE: 4 KiB ones"
BOUNCE_BYTES = PIECE
"""A request's aligned span: requests never straddle a multiple of ``PIECE`` (which is one of
4 KiB), so rounding their ends out to 4 KiB keeps them within one ``PIECE``-sized window."""
read_bounce_pool = BufferPool(BOUNCE_BYTES, keep=6)
"""The process's read bounce buffers, for requests with no piece read in place (small
tensors, destinations shared by two tensors), kept between loads (at most 4 + COPIERS = 6:
96 MiB) and unmapped after a minute unused: buffers mapped and faulted in afresh cost ~1.2 ms
a MiB on the dev VM (guest pages the host reclaimed fault in slowly)."""
SIDE_BYTES = 1 << 20
read_side_pool = BufferPool(SIDE_BYTES, keep=6, make=aligned_buffer)
"""Side buffers of requests reading in place (their pieces' last < 8 KiB, small pieces,
gaps): plain pages, faulted in only where a read lands."""

Done = Callable[[int, "str | None"], None]
"""``done(k, checksum)``: extent ``k`` is in; its content checksum, or None if not hashed."""


class ExtentEOFError(EOFError):
    """A data file ends before extent ``extent`` (an index into the extents read) does."""

    def __init__(self, message: str, extent: int) -> None:
        super().__init__(message)
        self.extent = extent


@dataclass
class _Extent:
    buf: memoryview
    length: int
    hasher: Hasher | None
    pos: int = 0
    ready: dict[int, int] = field(default_factory=dict)
    """Landed ranges ``lo -> hi`` beyond ``pos`` (pieces that came in out of order)."""
    busy: bool = False
    """A thread is hashing this extent; ranges that land meanwhile are left to it."""


class _Progress:
    """Which bytes of each extent have landed: hashed in order, ``done`` once all are in."""

    def __init__(self, done: Done, hashed: bool) -> None:
        self._done = done
        self._hashed = hashed
        self._extents: dict[int, _Extent] = {}
        self._lock = threading.Lock()

    def buffer(self, k: int, length: int, open_extent: Callable[[int], memoryview]) -> memoryview:
        """Extent ``k``'s buffer, opened on first use (one thread opens, in request order)."""
        ext = self._extents.get(k)
        if ext is None:
            buf = open_extent(k)
            ext = _Extent(buf, length, new_hasher() if self._hashed else None)
            with self._lock:
                self._extents[k] = ext
        return ext.buf

    def landed(self, k: int, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of extent ``k`` are in its buffer."""
        with self._lock:
            ext = self._extents[k]
            ext.ready[lo] = hi
            if ext.busy:
                return
            ext.busy = True
        while True:
            with self._lock:
                start = ext.pos
                end = ext.ready.pop(start, None)
                if end is None:
                    ext.busy = False
                    return
            if ext.hasher is not None:
                ext.hasher.update(ext.buf[start:end])
            with self._lock:
                ext.pos = end
                complete = end == ext.length
                if complete:
                    del self._extents[k]
            if complete:
                self._done(k, None if ext.hasher is None else format_checksum(ext.hasher))
                return


class DirectRead:
    """One read of whole extents ``(file name, offset, length)`` through O_DIRECT descriptors
    of ``open_file(name)``; on a file system that refuses O_DIRECT reads (EINVAL),
    ``refused(name, error)`` is told and the request is read through the page cache.
    At most ``streams`` requests read at a time. ``may_shift`` (see
    :data:`~dcp_plus.storage.direct_landing.MayShift`) says which unaligned destinations may
    be read in place; without it only aligned ones are."""

    def __init__(self, open_file: Callable[[str], int], location: Callable[[str], str],
                 bounce: BufferPool, refused: Callable[[str, OSError], None],
                 streams: int = 1, *, side: BufferPool = read_side_pool,
                 may_shift: MayShift | None = None) -> None:
        self._open_file = open_file
        self._location = location
        self._bounce = bounce
        self._side = side
        self._may_shift = may_shift
        self._refused = refused
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._streams = streams
        self._reading = threading.Semaphore(streams)
        self._extents: Sequence[tuple[str, int, int]] = ()

    def run(self, extents: Sequence[tuple[str, int, int]],
            open_extent: Callable[[int], memoryview], done: Done,
            executor: Executor | None = None, *, hashed: bool = False) -> None:
        """Read ``extents``: ``open_extent(k)`` just before the first request of ``k`` starts,
        ``done(k, checksum)`` once its last byte is in (``checksum`` only when ``hashed``).
        Requests read ``streams`` at a time on ``executor`` (on this thread without one),
        with :data:`COPIERS` more copying out meanwhile: give ``executor`` ``streams +
        COPIERS`` threads.
        The first failure stops the requests still to come and is raised
        (:class:`ExtentEOFError` for a file that ends before an extent does). Empty extents
        are neither opened nor done."""
        requests = _order(_plan(extents), self._streams)
        self._extents = extents
        progress = _Progress(done, hashed)

        def views(req: RangeRequest) -> list[memoryview | None]:
            return [None if k < 0 else progress.buffer(k, extents[k][2], open_extent)[lo:hi]
                    for k, lo, hi in req.pieces]
        try:
            if executor is None:
                for req in requests:
                    self._request(req, views(req), progress)
                return
            # a slot covers delivery too: buffers are bounded
            windowed(requests, views, lambda req, bufs: self._request(req, bufs, progress),
                     executor, self._streams + COPIERS)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = self._open_file(name)
            return fd

    def _request(self, req: RangeRequest, views: list[memoryview | None],
                 progress: _Progress) -> None:
        fd = self._fd(req.name)
        try:
            self._read(fd, req, views, progress)
        except OSError as e:
            if not is_refusal(e):
                raise
            self._refused(req.name, e)
            set_direct(fd, False)
            starts = _starts(req)
            read_coalesced(fd, self._location(req.name),
                           [(s, v) for s, v in zip(starts, views, strict=True) if v is not None])
            for k, lo, hi in req.pieces:
                if k >= 0:
                    progress.landed(k, lo, hi)

    def _read(self, fd: int, req: RangeRequest, views: list[memoryview | None],
              progress: _Progress) -> None:
        layout = lay_out(req.start, req.length, req.pieces, views, self._may_shift)
        if layout.side_bytes > self._bounce.size:  # _plan keeps requests inside a PIECE
            raise RuntimeError(f"{self._location(req.name)}: a request of "
                               f"{layout.side_bytes} bytes does not fit a "
                               f"{self._bounce.size}-byte bounce buffer")
        pool = self._side if layout.side_bytes <= self._side.size else self._bounce
        no_side = contextlib.nullcontext((memoryview(b""), 0))
        with pool.take_addressed() if layout.side_bytes else no_side as (side, side_at):
            iovecs = [side[at:at + n] if i < 0 else _view(layout.landings[i])[at:at + n]
                      for i, at, n in layout.segments]
            try:
                with self._reading:
                    got = preadv_upto(fd, iovecs, layout.start)
            finally:  # views of the side buffer left alive would keep the pool from unmapping it
                for v in iovecs:
                    v.release()
            if got < req.start + req.length - layout.start:
                raise self._eof(req, os.fstat(fd).st_size)
            for landing in layout.landings:
                if landing.view is not None:
                    _settle(landing, side_at, progress)

    def _eof(self, req: RangeRequest, size: int) -> ExtentEOFError:
        """The error for ``req``'s file ending at byte ``size``, naming the first extent the
        end cuts (requests do not run in file order: ``req`` may start past that extent)."""
        cut = [(off, k) for k, (name, off, n) in enumerate(self._extents)
               if name == req.name and n and off + n > size]
        return ExtentEOFError(f"{self._location(req.name)}: unexpected end of file at byte "
                              f"{size}", min(cut)[1] if cut else req.pieces[-1][0])


def _view(landing: Landing) -> memoryview:
    assert landing.view is not None  # only pieces with a destination are read in place
    return landing.view


def _settle(landing: Landing, side_at: int, progress: _Progress) -> None:
    """Put a read piece's bytes in place (moving its body down by ``shift``, copying the
    rest from the side buffer at ``side_at``), telling ``progress`` as each MiB is in."""
    k, lo, n = landing.k, landing.lo, landing.hi - landing.lo
    dst = address(_view(landing))
    if landing.shift > 0:
        _copy_landed(progress, k, lo, dst, dst + landing.shift, landing.body)
    elif landing.body:
        progress.landed(k, lo, lo + landing.body)
    _copy_landed(progress, k, lo + landing.body, dst + landing.body,
                 side_at + landing.side_at, n - landing.body)


def _copy_landed(progress: _Progress, k: int, lo: int, dst: int, src: int, n: int) -> None:
    """memmove ``n`` bytes (``dst`` below ``src`` if they overlap) a MiB at a time, each
    hashed right after, while in the CPU cache."""
    for s in range(0, n, HASH_STEP):
        m = min(HASH_STEP, n - s)
        copy_bytes(dst + s, src + s, m)
        progress.landed(k, lo + s, lo + s + m)


def _plan(extents: Sequence[tuple[str, int, int]]) -> list[RangeRequest]:
    """The requests: per file, in file order, neighbours coalesced and cut at the multiples
    of :data:`PIECE`, so the device sees long sequential reads whatever the extent sizes (a
    request of one extent's piece still goes straight into an aligned destination)."""
    return plan_requests(extents, GAP, PIECE)


def _order(requests: list[RangeRequest], streams: int) -> list[RangeRequest]:
    """``requests`` with those after the first ``streams`` that hold :data:`MANY_EXTENTS`
    extents or more moved up to follow them: each extent is checked and delivered on its own
    once in (~25 us), so a request of hundreds of small ones (biases, norms, optimizer steps:
    writers put them at the end of a file) takes ~10 ms after its read, all after the last
    read if it came last. Early, that work overlaps the reads after it; not first, so that
    opening its extents' destinations does not hold back the first reads."""
    def few(r: RangeRequest) -> bool:
        return sum(k >= 0 for k, _, _ in r.pieces) < MANY_EXTENTS
    return requests[:streams] + sorted(requests[streams:], key=few)  # stable: order kept


def _starts(req: RangeRequest) -> list[int]:
    """The file offset of each of ``req``'s pieces."""
    out, pos = [], req.start
    for _, lo, hi in req.pieces:
        out.append(pos)
        pos += hi - lo
    return out
