"""The O_DIRECT read pipeline (issue 19): requests that coalesce extents of any size and cut
at multiples of PIECE (sequential device reads), several streams reading while others copy
out and hash, into aligned and unaligned buffers of odd sizes, with the bounce buffers kept
by the process; and the transfer buffers those reads (and bounce-buffer writes) use.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.storage.buffers import HUGE_PAGE, BufferPool, transfer_buffer
from dcp_plus.storage.direct_extents import (
    COPIERS,
    MANY_EXTENTS,
    PIECE,
    ExtentEOFError,
    _order,
    _plan,
    read_bounce_pool,
)
from dcp_plus.storage.direct_read import DIRECT_ALIGN, address
from dcp_plus.storage.direct_store import DirectFileStore
from dcp_plus.storage.ranged import RangeRequest

MiB = 1 << 20
SIZES = [0, 1, 4095, 4097, 3 * MiB + 1, 2 * PIECE + 4097, 5, PIECE, 12 * MiB + 7]
"""Extent lengths, laid out 4 KiB-aligned one after another as a writer does."""


def layout(sizes: list[int]) -> list[tuple[int, int]]:
    out, off = [], 0
    for n in sizes:
        out.append((off, n))
        off += -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
    return out


def test_requests_coalesce_extents_of_any_size_and_cut_at_piece_multiples():
    extents = [("a", off, n) for off, n in layout(SIZES)] + [("b", 0, 3 * MiB)]
    requests = _plan(extents)
    assert [r.name for r in requests] == sorted(r.name for r in requests)  # file by file
    a = [r for r in requests if r.name == "a"]
    # one sequential run over the whole file: each request starts where the last ended
    assert all(x.start + x.length == y.start for x, y in zip(a, a[1:], strict=False))
    assert all(r.length <= PIECE and r.start % PIECE + r.length <= PIECE for r in a)
    assert all(r.start % PIECE == 0 for r in a[1:])
    covered = {k: 0 for k in range(len(SIZES))}
    for r in a:
        for k, lo, hi in r.pieces:
            if k >= 0:
                assert lo == covered[k]
                covered[k] = hi
    assert covered == dict(enumerate(SIZES))


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes, list[tuple[int, int]]]:
    extents = layout(SIZES)
    data = os.urandom(extents[-1][0] + extents[-1][1])
    (tmp_path / "f.dcpp").write_bytes(data)
    return tmp_path, data, extents


_KEEP: list[mmap.mmap] = []


def buffer(n: int, shift: int) -> memoryview:
    m = mmap.mmap(-1, n + shift + 1)
    _KEEP.append(m)
    return memoryview(m)[shift : shift + n]


@pytest.mark.parametrize("shift", [0, 64, 4095])
@pytest.mark.parametrize("streams", [1, 4])
def test_streams_with_copiers_fill_every_buffer_bit_exact_with_its_checksum(
        data_file, shift, streams):
    root, data, extents = data_file
    store = DirectFileStore(str(root), direct_io=True)
    assert store.uses_direct("f.dcpp")
    read_and_check(store, data, extents, shift, streams)


def read_and_check(store: DirectFileStore, data: bytes, extents: list[tuple[int, int]],
                   shift: int, streams: int, pooled: bool = True) -> None:
    """Read ``extents`` of ``f.dcpp`` into buffers ``shift`` bytes into a page, hashed (on
    ``streams + COPIERS`` threads, or on this one without ``pooled``), and check every byte
    and checksum (empty extents: never done)."""
    bufs = [buffer(n, shift) for _, n in extents]
    sums: dict[int, str | None] = {}
    with ThreadPoolExecutor(streams + COPIERS) as pool:
        store.read_direct([("f.dcpp", off, n) for off, n in extents], lambda k: bufs[k],
                          sums.__setitem__, pool if pooled else None, streams=streams,
                          hashed=True)
    for k, (off, n) in enumerate(extents):
        assert bytes(bufs[k]) == data[off : off + n], k
        if n:
            assert sums[k] == checksum_bytes(data[off : off + n])
    assert set(sums) == {k for k, (_, n) in enumerate(extents) if n}


def _request(name: str, at: int, extents: int) -> RangeRequest:
    return RangeRequest(name, at, [(at + k, 0, 10) for k in range(extents)])


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_requests_of_many_extents_after_the_first_ones_are_read_right_after_them(streams):
    plain = [_request("a", i * 100, 1) for i in range(6)]
    many = _request("a", 600, MANY_EXTENTS)  # exactly as many as it takes
    fewer = _request("b", 0, MANY_EXTENTS - 1)
    last = _request("b", 100, 1)
    planned = [*plain, many, fewer, last]
    assert _order(planned, streams) == [*plain[:streams], many, *plain[streams:], fewer, last]
    first = [many, *plain]  # among the first ones already: stays where it is
    assert _order(first, streams) == first


def test_the_requests_of_a_read_start_in_file_order_then_the_many_extents():
    small = [("a", 4 * PIECE + 3 * MiB + i * DIRECT_ALIGN, 100) for i in range(MANY_EXTENTS)]
    extents = [("a", 0, 4 * PIECE + 3 * MiB), *small, ("b", 0, 5 * PIECE)]
    planned = _plan(extents)
    assert [len(r.pieces) > MANY_EXTENTS for r in planned] == [False] * 4 + [True] + [False] * 5
    assert _order(planned, 2) == [*planned[:2], planned[4], *planned[2:4], *planned[5:]]


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("shift", [0, 64])
def test_a_file_ending_in_many_small_extents_reads_exact(tmp_path: Path, shift: int,
                                                         pooled: bool):
    # a big extent's last bytes share the request of the small ones, which is read before
    # the big one's middle: each extent is still hashed in order
    sizes = [3 * PIECE + MiB + 4097] + [1 + (i * 997) % 5000 for i in range(2 * MANY_EXTENTS)]
    extents = layout(sizes)
    data = os.urandom(extents[-1][0] + extents[-1][1])
    (tmp_path / "f.dcpp").write_bytes(data)
    store = DirectFileStore(str(tmp_path), direct_io=True)
    if not store.uses_direct("f.dcpp"):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    planned = _plan([("f.dcpp", off, n) for off, n in extents])
    assert len(planned) == 4 and _order(planned, 2)[2] is planned[3]  # before planned[2]
    read_and_check(store, data, extents, shift, streams=2, pooled=pooled)


def test_a_file_cut_short_names_the_first_extent_it_cuts_whatever_the_order(tmp_path: Path):
    sizes = [PIECE, PIECE, PIECE] + [100] * MANY_EXTENTS
    extents = layout(sizes)
    data = os.urandom(extents[-1][0] + extents[-1][1])
    cut = PIECE + 12345  # inside the second extent; the many small ones are read second
    (tmp_path / "f.dcpp").write_bytes(data[:cut])
    store = DirectFileStore(str(tmp_path), direct_io=True)
    if not store.uses_direct("f.dcpp"):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    assert _order(_plan([("f.dcpp", o, n) for o, n in extents]), 1)[1].pieces[-1][0] > 2
    bufs = [buffer(n, 0) for _, n in extents]
    with pytest.raises(ExtentEOFError) as info:
        store.read_direct([("f.dcpp", off, n) for off, n in extents], lambda k: bufs[k],
                          lambda k, s: None)
    assert info.value.extent == 1 and f"at byte {cut}" in str(info.value)


def test_the_bounce_buffers_outlive_a_store(data_file):
    root, _, extents = data_file
    for _ in range(2):
        store = DirectFileStore(str(root), direct_io=True)
        assert store.uses_direct("f.dcpp")
        bufs = [buffer(n, 64) for _, n in extents]
        store.read_direct([("f.dcpp", off, n) for off, n in extents], bufs.__getitem__,
                          lambda k, s: None)
        store.close()
    with read_bounce_pool.take() as view:
        assert len(view) == read_bounce_pool.size  # taken from the kept ones, whole size


@pytest.mark.parametrize("n", [1, 4096, HUGE_PAGE, HUGE_PAGE + 1, 3 * HUGE_PAGE - 5])
def test_transfer_buffers_are_zeroed_aligned_and_whole_huge_pages(n):
    buf = transfer_buffer(n)
    try:
        assert len(buf) >= n and len(buf) % HUGE_PAGE == 0
        assert address(memoryview(buf)) % DIRECT_ALIGN == 0
        assert buf[:] == bytes(len(buf))
    finally:
        buf.close()


def test_a_pool_hands_out_views_of_exactly_its_size():
    pool = BufferPool(3 * DIRECT_ALIGN, keep=1)
    with pool.take() as a:
        a[:] = b"x" * len(a)
    with pool.take() as b:  # the same buffer again, contents stale
        assert len(b) == 3 * DIRECT_ALIGN
    pool.close()


def test_a_pool_unused_for_its_idle_time_unmaps_its_buffers():
    pool = BufferPool(DIRECT_ALIGN, keep=2, idle_s=None)
    with pool.take(), pool.take():
        pass
    assert pool.idle == 2
    assert pool.release_idle(older_than=3600) == 0  # used just now: kept
    assert pool.release_idle() == 2 and pool.idle == 0
    timed = BufferPool(DIRECT_ALIGN, keep=1, idle_s=0.05)
    with timed.take():
        pass
    deadline = time.monotonic() + 30
    while timed.idle and time.monotonic() < deadline:  # the pool's timer unmaps it
        time.sleep(0.01)
    assert timed.idle == 0
    with timed.take() as view:  # and a new one is made on the next use
        assert len(view) == DIRECT_ALIGN
    timed.close()
