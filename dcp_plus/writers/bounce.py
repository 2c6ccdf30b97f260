"""Data outside stager slabs written with O_DIRECT through aligned bounce buffers.

Tensor memory is rarely 4 KiB-aligned, so the file is assembled chunk by chunk in
page-aligned buffers (items at their offsets, zeros between them) and each chunk is written
with O_DIRECT; ``streams`` chunks are in flight at once. The file's last < 4 KiB go through
the page cache before the fsync, so the file ends exactly at its last byte.
"""

from __future__ import annotations

import bisect
import ctypes
import os
from collections.abc import Callable
from functools import partial

from dcp_plus.storage.direct import BOUNCE_BYTES, DirectFile, bounce_pool
from dcp_plus.storage.direct_read import address, copy_bytes
from dcp_plus.storage.fanout import in_streams
from dcp_plus.storage.ranged import Segments


def _bytes(data: memoryview) -> memoryview:
    return data.cast("B") if data.format != "B" or data.ndim != 1 else data


def write_segments(path: str, segments: Segments, size: int, *, direct: bool, streams: int,
                   fsync: bool, pace: Callable[[int], None] | None = None) -> None:
    """Write ``(offset, bytes)`` ``segments`` (not overlapping) into the existing empty file
    ``path`` of final length ``size``, fsync it (``fsync``) and drop it from the page cache.
    Without ``direct`` (a file system refusing O_DIRECT) the segments are written buffered as
    they are, with no copy. ``pace``: see :class:`~dcp_plus.storage.direct.DirectFile`."""
    segs = sorted(((off, _bytes(d)) for off, d in segments if len(d)), key=lambda s: s[0])
    f = DirectFile(path, direct=direct, drop_cache=True, pace=pace)
    try:
        if not f.direct:
            for off, data in segs:
                f.write(data, off, aligned=False)
            if os.fstat(f.fd).st_size < size:  # empty items placed after the last byte
                os.ftruncate(f.fd, size)
        else:
            if streams > 1:
                f.preallocate(size)
            ends = [off + len(d) for off, d in segs]
            tasks: list[Callable[[], None]] = [
                partial(_write_chunk, f, segs, ends, start, min(size, start + BOUNCE_BYTES))
                for start in range(0, size, BOUNCE_BYTES)]
            in_streams(streams, tasks)
    except BaseException:
        f.close()
        raise
    f.finish(fsync)


def _write_chunk(f: DirectFile, segs: list[tuple[int, memoryview]], ends: list[int],
                 start: int, end: int) -> None:
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
        f.write(buf[: end - start], start, aligned=True)
