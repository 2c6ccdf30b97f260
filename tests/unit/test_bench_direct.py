"""The benchmarks' O_DIRECT limits and page-cache measurement, on real files.

ext4 (``tmp_path``) takes O_DIRECT; a ramfs mounted for the test refuses it (EINVAL), which is
what the limits must then report instead of failing.
"""

from __future__ import annotations

import mmap
import os

import pytest

from dcp_plus.cli.bench.config import BenchConfig
from dcp_plus.cli.bench.copy_beside import CopyBeside
from dcp_plus.cli.bench.limits import (
    CHUNK,
    STREAMS,
    aligned_buffer,
    direct_read,
    direct_refusal,
    pwrite_files,
    read_plan,
    ring_buffers,
)
from dcp_plus.cli.bench.machine import evict_files
from dcp_plus.cli.bench.measure import _Storage, measure_limits
from dcp_plus.cli.bench.pagecache import cached_now, residency, resident_bytes
from dcp_plus.cli.bench.report import DIRECT_ROWS, build, render
from tests.conftest import mounted

MiB = 1 << 20


@pytest.fixture
def ramfs():
    """A ramfs (``mount -t ramfs``): a real file system without O_DIRECT."""
    with mounted("ramfs", prefix="dcpp-ramfs-") as path:
        yield path


def _pattern(n: int):
    buf = aligned_buffer(n)
    buf[:n] = os.urandom(n)
    return buf


# ---------------------------------------------------------------------- page cache residency

def test_a_buffered_write_is_resident_until_dropped(tmp_path):
    f = tmp_path / "buffered.bin"
    f.write_bytes(os.urandom(8 * MiB + 123))
    assert resident_bytes(str(f)) >= 0.9 * f.stat().st_size
    evict_files([str(f)])  # fsync, then DONTNEED (it drops clean pages only)
    r = residency([str(tmp_path)])
    assert (r.resident, r.total, r.method) == (0, 8 * MiB + 123, "mincore")
    f.read_bytes()  # a buffered read brings it all back
    assert residency([str(f)]).fraction == 1.0


@pytest.mark.parametrize("nbytes", [8 * MiB, 8 * MiB + 4097])
def test_an_o_direct_write_leaves_at_most_the_buffered_tail_page(direct_dir, nbytes):
    buf = _pattern(nbytes)
    files = pwrite_files(memoryview(buf), nbytes, str(direct_dir), streams=2, direct=True)
    r = residency(files)
    assert r.total == nbytes
    assert r.resident == nbytes % 4096  # the sub-4 KiB tail went through the page cache


def test_residency_counts_partial_pages_and_empty_files(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "one").write_bytes(b"x")
    r = residency([str(tmp_path)])
    assert (r.resident, r.total) == (1, 1) and r.fraction == 1.0
    assert residency([]).fraction == 0.0
    assert cached_now() > 0


# ---------------------------------------------------------------------- O_DIRECT limits

@pytest.mark.parametrize("nbytes", [4096, 4097, 3 * MiB + 1, 9 * MiB])
@pytest.mark.parametrize("write_streams", STREAMS)
def test_o_direct_write_then_read_is_bit_exact_with_every_stream_count(direct_dir, nbytes,
                                                                       write_streams):
    src = _pattern(nbytes)
    files = pwrite_files(memoryview(src), nbytes, str(direct_dir), write_streams, direct=True)
    assert len(files) == write_streams
    assert sum(os.path.getsize(f) for f in files) == nbytes
    for read_streams in STREAMS:
        dst = aligned_buffer(nbytes + write_streams * 4096)
        assert direct_read(files, read_streams, memoryview(dst)) == nbytes
        got = b"".join(dst[off:off + os.path.getsize(f)] for off, f in
                       zip(_offsets(files), files, strict=True))
        assert got == src[:nbytes], (write_streams, read_streams)


def _offsets(files: list[str]) -> list[int]:
    out, at = [], 0
    for f in files:
        out.append(at)
        at += -(-os.path.getsize(f) // 4096) * 4096
    return out


def test_read_plan_splits_aligned_disjoint_requests_over_the_streams():
    sizes = [5 * MiB + 7, 0, 3 * MiB]
    plan = read_plan(sizes, 3, chunk=MiB)
    assert len(plan) == 3 and all(plan)
    reqs = [r for run in plan for r in run]
    assert all(off % 4096 == 0 and at % 4096 == 0 and n % 4096 == 0 for _, off, at, n in reqs)
    for k, size in enumerate(sizes):
        covered = sorted((off, off + n) for kk, off, _, n in reqs if kk == k)
        assert [a for a, _ in covered] == list(range(0, size, MiB))  # each chunk once
        assert not covered or covered[-1][1] >= size
    assert len({at for _, _, at, _ in reqs}) == len(reqs)  # no two land on one place


def test_a_short_buffer_is_refused_with_the_sizes(direct_dir):
    src = _pattern(8192)
    files = pwrite_files(memoryview(src), 8192, str(direct_dir), 1, direct=True)
    with pytest.raises(ValueError, match="holds 4096 bytes, the files need 8192"):
        direct_read(files, 1, memoryview(aligned_buffer(4096)))


def test_ramfs_refuses_o_direct_and_the_limits_say_so(ramfs):
    reason = direct_refusal(str(ramfs))
    assert reason is not None and reason.startswith("O_DIRECT refused by ramfs")
    assert not list(ramfs.iterdir()), "the probe file was left behind"
    cfg = BenchConfig(target=str(ramfs), size=MiB)
    lim = measure_limits(_Storage(cfg, str(ramfs)), MiB, 0, 1)
    assert lim["direct_refused"] == reason
    assert _finite(lim["write_s"]) and _finite(lim["read_s"])  # the buffered ones still run
    assert not [k for k in lim if k.startswith("direct") and k != "direct_refused"]
    res = {"nbytes": MiB, "limits": lim, "order": [], "kinds": {}, "cases": {},
           "shape": {"d_model": 64, "layers": 1, "params": 1, "tensors": 1}, "fs": "ramfs"}
    result = build(cfg, res, None, {})
    for name in DIRECT_ROWS:
        assert result["rows"][name]["na"] == f"n/a: {reason}"
    result["load1"] = {"start": 0.0}
    lines = render(result).splitlines()
    for name in DIRECT_ROWS:
        assert any(ln.startswith(name) and ln.endswith(f"  n/a: {reason}") for ln in lines)


def test_the_limits_on_ext4_have_every_stream_count(direct_dir):
    cfg = BenchConfig(target=str(direct_dir), size=2 * MiB)
    lim = measure_limits(_Storage(cfg, str(direct_dir)), 2 * MiB + 5, 0, 1)
    assert lim["direct_refused"] is None
    for k in STREAMS:
        for h in ("", "h"):  # from the state's pages, and from huge-page rings
            assert _finite(lim[f"direct{k}{h}_write_s"]) and _finite(lim[f"direct{k}{h}_read_s"])
    assert not [p for p in direct_dir.rglob("*") if p.is_file()], "the limits left files"


def _finite(v: object) -> bool:
    return isinstance(v, float) and v > 0


@pytest.mark.parametrize("streams", STREAMS)
def test_the_huge_page_limits_write_and_read_the_byte_count_through_the_rings(direct_dir,
                                                                             streams):
    nbytes = 2 * CHUNK + 3 * MiB + 5  # more than one ring's worth per stream at 1 stream
    rings = ring_buffers(streams)
    assert len(rings) == streams and all(len(r) == CHUNK for r in rings)
    assert ring_buffers(streams)[0].obj is rings[0].obj  # kept, not made again
    files = pwrite_files(None, nbytes, str(direct_dir), streams, True, rings)
    assert sum(os.path.getsize(f) for f in files) == nbytes
    assert residency(files).resident == nbytes % 4096  # only the tail page was buffered
    evict_files(files)
    assert direct_read(files, streams, None, rings) == nbytes
    with pytest.raises(ValueError, match="rings of"):
        direct_read(files, streams, None, rings[:streams - 1] or [rings[0][:4096]])



def test_a_copy_beside_copies_its_byte_count_round_its_buffers_by_the_block_end():
    bufs = (mmap.mmap(-1, MiB), mmap.mmap(-1, MiB))
    bufs[0][:] = os.urandom(MiB)
    beside = CopyBeside(3 * MiB + 5, bufs)
    with beside:
        pass
    assert beside.copied == 3 * MiB + 5
    assert bufs[1][:] == bufs[0][:]
    with pytest.raises(RuntimeError, match="runs once"), beside:
        pass


def test_a_copy_beside_stops_when_its_block_raises():
    beside = CopyBeside(1 << 50, (mmap.mmap(-1, MiB), mmap.mmap(-1, MiB)))  # 1 PiB: never
    with pytest.raises(ValueError, match="the block"), beside:
        raise ValueError("the block")
    assert 0 < beside.copied < 1 << 50
