"""Physical limits a checkpoint cannot beat on this machine.

- memcpy: one ``copy_`` of the state's byte count into a pre-faulted shared-memory buffer
  (what staging costs at best);
- buffered durable write: the same bytes from warm memory, one ``pwrite`` stream + ``fsync``
  (through the page cache) — for URLs, one object ``pipe`` through fsspec;
- buffered cold read: ``dd`` of the written file from a cold page cache — for URLs, one
  object ``cat``;
- O_DIRECT write and read (:func:`pwrite_files` with ``direct``, :func:`direct_read`): the
  same bytes with the page cache bypassed, by 1, 2 or 4 streams (:data:`STREAMS`); the best
  of them is what the device takes and gives (the write and read limits of a durable save /
  cold load). :func:`direct_refusal` says where the file system refuses O_DIRECT. With
  ``rings`` (:func:`ring_buffers`) each stream writes from / reads into its own reusable
  huge-page buffer instead of the state's bytes: the device's best (see there); timed inside
  a :class:`~dcp_plus.cli.bench.copy_beside.CopyBeside`, the floor for memory O_DIRECT cannot
  address.

Shared by ``benchmarks/save_load.py``, ``benchmarks/direct_rounds.py``,
``benchmarks/staging.py``, ``benchmarks/compression.py`` and ``dcp-plus bench``.
"""

from __future__ import annotations

import bisect
import errno
import functools
import itertools
import math
import mmap
import os
import subprocess
import time
from typing import Any

import torch

from dcp_plus.cli.bench.machine import fs_type
from dcp_plus.format.layout import align_up
from dcp_plus.memory.slabs import Slab
from dcp_plus.storage.buffers import aligned_buffer as page_aligned
from dcp_plus.storage.buffers import transfer_buffer
from dcp_plus.storage.direct_read import address, preadv_upto
from dcp_plus.storage.fanout import in_streams

CHUNK = 64 << 20
BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses
STREAMS = (1, 2, 4)
"""The stream counts of the O_DIRECT limits; the best of them is the limit."""


class MemcpyLimit:
    """One ``copy_`` of ``nbytes`` into a pre-faulted shared buffer (kept for re-measuring).

    The slab is ``nbytes`` rounded up to 4 KiB: its buffer is also a :func:`direct_read`
    destination for the files written from it.
    """

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8)
        self.src.fill_(1)
        self.slab = Slab(align_up(nbytes))
        self.dst = self.slab.tensor()[:nbytes]
        self.dst.zero_()  # pre-fault

    def measure(self, repeats: int = 3) -> float:
        best = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            self.dst.copy_(self.src)
            best = min(best, time.perf_counter() - t)
        return best

    def close(self) -> None:
        del self.dst, self.src
        self.slab.close()


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` rounded up to 4 KiB, pre-faulted (warm
    memory, like a live model's tensors): a destination for :func:`direct_read`."""
    m = page_aligned(nbytes)
    zeros = bytes(min(len(m), CHUNK))
    for at in range(0, len(m), len(zeros)):
        m[at:at + len(zeros)] = zeros[:len(m) - at]
    return m


_RINGS: list[mmap.mmap] = []


def ring_buffers(streams: int) -> list[memoryview]:
    """One reusable buffer of :data:`CHUNK` bytes per stream, in transparent huge pages
    (:func:`dcp_plus.storage.buffers.transfer_buffer`), made once per process and kept.

    What the device takes and gives at best: virtio-blk carries at most 254 memory segments
    per request, so from scattered 4 KiB pages (a ``/dev/shm`` slab, an anonymous buffer) a
    request tops out near 1 MiB, from 2 MiB pages at the device's 4 MiB. Each stream writes
    every 64 MiB request of its slice from (and reads every one into) the same ring, so an
    8 GiB limit needs no second 8 GiB: the content of the bytes does not matter to the device
    (only their count, offsets and the memory's layout), so the files hold repeats of the
    ring, not the state."""
    while len(_RINGS) < streams:
        _RINGS.append(transfer_buffer(CHUNK))
    return [memoryview(m)[:CHUNK] for m in _RINGS[:streams]]


def direct_refusal(d: str) -> str | None:
    """Why the file system holding directory ``d`` cannot serve as an O_DIRECT limit, or None.

    Probes with one aligned 4 KiB block written and read back with ``O_DIRECT`` (tmpfs before
    Linux 6.6, ramfs, some FUSE and network file systems refuse it with EINVAL at ``open`` or
    at the first request). The answer reads ``O_DIRECT refused by <fs> (<error>)``.
    """
    path = os.path.join(d, f".dcpp-odirect-probe-{os.getpid()}")
    block = mmap.mmap(-1, BLOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, block, 0)
            os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        return f"O_DIRECT refused by {fs_type(d).split(' ')[0]} ({os.strerror(e.errno)})"
    finally:
        block.close()
        if os.path.exists(path):
            os.unlink(path)
    return None


def read_plan(sizes: list[int], streams: int,
              chunk: int = CHUNK) -> list[list[tuple[int, int, int, int]]]:
    """How ``streams`` threads read files of ``sizes`` into one buffer: per stream, a
    contiguous run of ``(file index, file offset, buffer offset, length)`` requests of at most
    ``chunk`` bytes, 4 KiB-aligned (the last of a file rounded up: O_DIRECT reads it short);
    file ``k`` lands at the buffer offset of the aligned sizes before it. The runs are disjoint
    and near-equal in bytes."""
    reqs: list[tuple[int, int, int, int]] = []
    base = 0
    for k, n in enumerate(sizes):
        reqs += [(k, off, base + off, min(chunk, align_up(n) - off)) for off in range(0, n, chunk)]
        base += align_up(n)
    total = sum(r[3] for r in reqs)
    plan: list[list[tuple[int, int, int, int]]] = [[] for _ in range(streams)]
    done = 0
    for r in reqs:
        plan[min(streams - 1, done * streams // max(total, 1))].append(r)
        done += r[3]
    return plan


class Scatter:
    """Page-aligned ``regions`` (4 KiB-aligned starts and lengths) read as one buffer: byte
    ``at`` of it is byte ``at`` of their concatenation. A limit read into the memory of a
    state's own tensors (their 4 KiB-aligned interiors), whose pages the kernel placed as it
    placed them."""

    def __init__(self, regions: list[memoryview]) -> None:
        bad = [i for i, r in enumerate(regions)
               if len(r) % BLOCK or address(r) % BLOCK]
        if bad:
            raise ValueError(f"Scatter: region {bad[0]} is not 4 KiB-aligned")
        self.regions = regions
        self.starts = list(itertools.accumulate((len(r) for r in regions), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def views(self, at: int, n: int) -> list[memoryview]:
        """The slices of the regions that hold bytes ``[at, at + n)``."""
        out = []
        i = bisect.bisect_right(self.starts, at) - 1
        while n > 0:
            lo = at - self.starts[i]
            m = min(n, len(self.regions[i]) - lo)
            out.append(self.regions[i][lo:lo + m])
            at, n, i = at + m, n - m, i + 1
        return out


def _pieces(buf: memoryview | Scatter | None, rings: list[memoryview] | None, stream: int,
            at: int, n: int) -> list[memoryview]:
    """Where ``n`` bytes at ``at`` of ``buf`` are, or (``rings``) the first ``n`` of the
    stream's ring."""
    if rings is not None:
        return [rings[stream][:n]]
    assert buf is not None, "a buffer or rings"
    return buf.views(at, n) if isinstance(buf, Scatter) else [buf[at:at + n]]


def read_span(files: list[str]) -> int:
    """The bytes a buffer needs to take ``files`` by :func:`direct_read`: each file's size
    rounded up to 4 KiB."""
    return sum(align_up(os.path.getsize(f)) for f in files)


def direct_read(files: list[str], streams: int, into: memoryview | Scatter | None,
                rings: list[memoryview] | None = None) -> int:
    """Read ``files`` with O_DIRECT by ``streams`` threads (:func:`read_plan`) into ``into``
    (page-aligned, at least the files' 4 KiB-rounded sizes: an :func:`aligned_buffer` or a
    :class:`Scatter`), or,
    with ``rings`` (:func:`ring_buffers`, one per stream), every request of stream ``s``
    into ``rings[s]`` over the last. Returns the bytes read; raises if a file came back
    shorter than its size."""
    sizes = [os.path.getsize(f) for f in files]
    need = read_span(files)
    if rings is not None:
        if len(rings) < streams or min(len(r) for r in rings) < CHUNK:
            raise ValueError(f"direct_read: {streams} rings of {CHUNK} bytes needed")
    elif into is None or len(into) < need:
        have = 0 if into is None else len(into)
        raise ValueError(f"direct_read: the buffer holds {have} bytes, the files need "
                         f"{need} (4 KiB-rounded)")
    fds: list[int] = []
    plan = read_plan(sizes, streams)
    got = [[0] * len(files) for _ in plan]  # per stream: no shared counter between threads

    def one(s: int) -> None:
        for k, off, at, n in plan[s]:
            got[s][k] += preadv_upto(fds[k], _pieces(into, rings, s, at, n), off)

    try:
        for f in files:
            fds.append(os.open(f, os.O_RDONLY | os.O_DIRECT))
        in_streams(streams, [functools.partial(one, i) for i in range(streams)])
    finally:
        for fd in fds:
            os.close(fd)
    for k, (f, n) in enumerate(zip(files, sizes, strict=True)):
        if sum(g[k] for g in got) != n:
            raise OSError(f"direct_read: {f}: read {sum(g[k] for g in got)} of {n} bytes")
    return sum(sizes)


def pwrite_files(buf: memoryview | None, nbytes: int, d: str, streams: int = 1,
                 direct: bool = False, rings: list[memoryview] | None = None) -> list[str]:
    """Write ``buf[:nbytes]`` into ``streams`` files ``d/pwrite{i}.bin`` by as many threads
    (stream ``i`` writes file ``i``: a disjoint 4 KiB-aligned slice of the bytes, in 64 MiB
    requests), then ``fsync`` each; returns the files written.

    ``direct``: the O_DIRECT write limit: the 4 KiB-aligned body of each file bypasses the page
    cache; the sub-4 KiB tail of the last file goes through a buffered descriptor (one page).
    ``buf`` must then be page-aligned (a slab, an :func:`aligned_buffer`). One file per stream:
    ext4 serialises extending writes to one file, O_DIRECT ones included.

    ``rings`` (:func:`ring_buffers`, one per stream; ``buf`` unused): stream ``i`` writes
    every request from the start of ``rings[i]``: ``nbytes`` of the device's best, not the
    state's bytes.
    """
    per = nbytes // streams // BLOCK * BLOCK
    bounds = [(i * per, (i + 1) * per if i < streams - 1 else nbytes) for i in range(streams)]
    paths = [os.path.join(d, f"pwrite{i}.bin") for i in range(streams)]

    def one(i: int) -> None:
        lo, hi = bounds[i]
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        dfd = os.open(paths[i], os.O_WRONLY | os.O_DIRECT) if direct else fd
        try:
            body = lo + (hi - lo) // BLOCK * BLOCK if direct else hi
            for start, end, f in ((lo, body, dfd), (body, hi, fd)):
                done = start
                while done < end:
                    n = min(CHUNK, end - done)
                    done += os.pwrite(f, _pieces(buf, rings, i, done, n)[0], done - lo)
            os.fsync(fd)
        finally:
            if dfd != fd:
                os.close(dfd)
            os.close(fd)

    in_streams(streams, [functools.partial(one, i) for i in range(streams)])
    return paths


def dd_read(files: list[str], parallel: bool = False) -> None:
    """``dd if=F of=/dev/null bs=64M`` over ``files``, one after another or all at once
    (buffered: the page cache fills; :func:`direct_read` bypasses it)."""
    cmds = [["dd", f"if={f}", "of=/dev/null", "bs=64M", "status=none"] for f in files]
    if parallel:
        procs = [subprocess.Popen(c) for c in cmds]
        for p in procs:
            if p.wait():
                raise RuntimeError(f"dd failed: {' '.join(p.args)}")  # type: ignore[arg-type]
    else:
        for c in cmds:
            subprocess.run(c, check=True)


def url_write(fs: Any, url: str, data: bytes) -> None:
    """One object holding ``data``, through fsspec (the client stack's floor for a save)."""
    fs.pipe_file(url, data)


def url_read(fs: Any, url: str) -> int:
    """Read one object back through fsspec; returns its length."""
    return len(fs.cat_file(url))
