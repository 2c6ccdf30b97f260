"""Data outside stager slabs written with O_DIRECT through aligned bounce buffers.

Tensor memory is rarely 4 KiB-aligned, so the file is assembled chunk by chunk in
page-aligned buffers (items at their offsets, zeros between them) and each chunk is written
with O_DIRECT; ``streams`` chunks are in flight at once while the next is assembled. The file's last < 4 KiB go through
the page cache before the fsync, so the file ends exactly at its last byte.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial

from dcp_plus.storage.direct import BOUNCE_BYTES, DirectFile, bounce_pool
from dcp_plus.storage.direct_read import address, copy_bytes
from dcp_plus.storage.fanout import in_streams
from dcp_plus.storage.ranged import Segments


def _bytes(data: memoryview) -> memoryview:
    return data.cast("B") if data.format != "B" or data.ndim != 1 else data


RAMP = (4 << 20, 8 << 20, 16 << 20, 32 << 20)
"""The chunk lengths a write starts with (each once per stream), and ends with about in
reverse (powers of two of what is left per stream), around :data:`~dcp_plus.storage.direct.BOUNCE_BYTES` chunks. Every stream first copies its
chunk and only then writes it: four 64 MiB copies at once on two cores held the first write
back 25-30 ms, four 4 MiB ones hold it back ~2 ms. At the end, short chunks let the streams
finish within a few ms of each other instead of up to one 64 MiB write apart."""

COPIERS = 1
"""Threads beyond ``streams``: one assembles its next chunk while ``streams`` others write,
so a stream that finishes a write starts the next at once instead of first copying 64 MiB.
With :data:`RAMP` and the shared queue, a plain ``dcp.save`` of 8 GiB took 0.942x and 0.986x
the time of the per-file streams before (same-round medians of two 4-round runs; 2 GiB:
1.012x, no change; ``docs/benchmarks.md``, tenth session)."""

BounceFile = tuple[str, Segments, int]
"""``(path, (offset, bytes) segments not overlapping, final size)`` of one file."""


def write_files(files: Sequence[BounceFile], *, direct: bool, streams: int, fsync: bool,
                pace: Callable[[int], None] | None = None) -> None:
    """Write ``files`` (each an existing empty file, see :data:`BounceFile`), fsync them
    (``fsync``) and drop them from the page cache. ``streams`` threads (and :data:`COPIERS`
    more with ``direct``) take the work from one queue: with ``direct``, the chunks of all
    files (:func:`chunk_plan`: no stream idles while another file has chunks left); without
    it (a file system refusing O_DIRECT) a file at a time, its segments written buffered as
    they are, with no copy. ``pace``: see :class:`~dcp_plus.storage.direct.DirectFile`."""
    opened: list[DirectFile] = []
    try:
        segs: list[list[tuple[int, memoryview]]] = []
        for path, segments, _ in files:
            opened.append(DirectFile(path, direct=direct, drop_cache=True, pace=pace))
            segs.append(sorted(((off, _bytes(d)) for off, d in segments if len(d)),
                               key=lambda s: s[0]))
        tasks: list[Callable[[], None]] = []  # the buffered files', then the chunks
        for f, fsegs, (_, _, size) in zip(opened, segs, files, strict=True):
            if not f.direct:
                tasks.append(partial(_write_buffered, f, fsegs, size))
            elif streams > 1:
                f.preallocate(size)
        ends = [[off + len(d) for off, d in fsegs] for fsegs in segs]
        sizes = [size if f.direct else 0 for f, (_, _, size) in zip(opened, files, strict=True)]
        writing = threading.Semaphore(max(1, streams))
        chunks: list[Callable[[], None]] = [
            partial(_write_chunk, opened[i], segs[i], ends[i], start, end, writing)
            for i, start, end in chunk_plan(sizes, streams)]
        in_streams(streams + (COPIERS if chunks else 0), tasks + chunks)
        in_streams(max(1, streams), [partial(f.finish, fsync) for f in opened])  # fsyncs at once
    finally:
        for f in opened:  # after a failure; finish() closed the others
            f.close()


def _write_buffered(f: DirectFile, segs: list[tuple[int, memoryview]], size: int) -> None:
    for off, data in segs:
        f.write(data, off, aligned=False)
    if os.fstat(f.fd).st_size < size:  # empty items placed after the last byte
        os.ftruncate(f.fd, size)


def chunk_plan(sizes: Sequence[int], streams: int) -> list[tuple[int, int, int]]:
    """``(file index, start, end)`` chunks covering files of ``sizes`` bytes, taking the
    files in turn (4 streams on one file, then the next, ran 1.075x slower at 8 GiB than
    with the streams spread over the files) and each file in order. The ``k``-th chunk is
    at most ``RAMP[k // streams]`` long (then ``BOUNCE_BYTES``, the most any chunk is) and,
    with ``left`` bytes of all files still to plan, at most the power of two below ``left /
    streams`` (at least ``RAMP[0]``): the lengths ramp up, then down again at the end. A
    chunk never spans two files, so a file's chunks start at multiples of 4 KiB."""
    per = max(1, streams)
    left = sum(sizes)
    at = [0] * len(sizes)
    out: list[tuple[int, int, int]] = []
    while left:
        for i, size in enumerate(sizes):
            if at[i] == size:
                continue
            k = len(out) // per
            up = RAMP[k] if k < len(RAMP) else BOUNCE_BYTES
            share = left // per
            down = 1 << (share.bit_length() - 1) if share else 0
            end = min(size, at[i] + min(up, max(RAMP[0], down), BOUNCE_BYTES))
            out.append((i, at[i], end))
            left -= end - at[i]
            at[i] = end
    return out


def _write_chunk(f: DirectFile, segs: list[tuple[int, memoryview]], ends: list[int],
                 start: int, end: int, writing: threading.Semaphore) -> None:
    """Assemble file bytes ``[start, end)`` in a bounce buffer and write them. The copies
    run without the GIL (tensor memory is writable, so it has an address), so the streams
    copy on both cores at once instead of taking turns."""
    with bounce_pool.take_addressed() as (buf, at):
        pos = start
        i = bisect.bisect_right(ends, start)  # the first segment ending after ``start``
        while i < len(segs) and segs[i][0] < end:
            off, data = segs[i]
            lo, hi = max(off, start), min(off + len(data), end)
            if lo > pos:
                ctypes.memset(at + pos - start, 0, lo - pos)
            if data.readonly:  # bytes (byte values, compressed frames): no address to take
                buf[lo - start : hi - start] = data[lo - off : hi - off]
            else:
                copy_bytes(at + lo - start, address(data) + lo - off, hi - lo)
            pos = hi
            i += 1
        if pos < end:
            ctypes.memset(at + pos - start, 0, end - pos)
        with writing:
            f.write(buf[: end - start], start, aligned=True)
