"""The read limit into a state's own memory: ``Scatter`` lands the files' bytes in order across
its regions (more of them than one ``preadv`` takes, too), refuses unaligned ones, and
``benchmarks.state_memory`` picks each tensor's aligned interior and measures page runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.state_memory import MIN_REGION, contiguity, interiors, state_scatter
from dcp_plus.cli.bench.limits import Scatter, aligned_buffer, direct_read
from dcp_plus.storage.direct_read import IOV_MAX, address

PAGE = 4096


def _files(d: Path, sizes: list[int]) -> list[str]:
    out = []
    for i, n in enumerate(sizes):
        path = d / f"f{i}"
        path.write_bytes(os.urandom(n))
        out.append(str(path))
    return out


@pytest.mark.parametrize("streams", [1, 4])
def test_a_scatter_takes_the_files_bytes_in_order_across_its_regions(direct_dir: Path,
                                                                     streams: int):
    files = _files(direct_dir, [3 * PAGE * 1000 + 5, 7 * PAGE])  # the first rounds up a page
    need = 3 * PAGE * 1000 + PAGE + 7 * PAGE
    # regions of 1, 2 and 3 pages from separate buffers: more than IOV_MAX in one request
    bufs = [aligned_buffer(PAGE * (1 + i % 3)) for i in range(need // (2 * PAGE) + 3)]
    regions = [memoryview(b) for b in bufs]
    scatter = Scatter(regions)
    assert len(scatter) >= need and len(regions) > IOV_MAX
    assert direct_read(files, streams, scatter) == sum(os.path.getsize(f) for f in files)
    got = b"".join(bytes(r) for r in regions)
    first = Path(files[0]).read_bytes()
    assert got[:len(first)] == first
    second = -(-len(first) // PAGE) * PAGE  # where the second file lands
    assert got[second:second + 7 * PAGE] == Path(files[1]).read_bytes()


def test_a_scatter_names_its_first_unaligned_region():
    buf = memoryview(aligned_buffer(4 * PAGE))
    with pytest.raises(ValueError, match="region 1 is not 4 KiB-aligned"):
        Scatter([buf[:PAGE], buf[PAGE + 64:2 * PAGE + 64]])
    with pytest.raises(ValueError, match="region 0 is not 4 KiB-aligned"):
        Scatter([buf[:PAGE + 1]])


def test_interiors_are_the_aligned_part_of_each_large_contiguous_cpu_tensor():
    big = torch.empty(MIN_REGION + 3 * PAGE, dtype=torch.uint8)
    small = torch.empty(MIN_REGION // 2, dtype=torch.uint8)
    strided = torch.empty(4, MIN_REGION, dtype=torch.uint8).t()
    out = interiors([big, small, strided, big.view(torch.int32)])
    assert len(out) == 2
    for view in out:
        start = address(view)
        assert start % PAGE == 0 and len(view) % PAGE == 0 and len(view) >= MIN_REGION
        assert big.data_ptr() <= start and start + len(view) <= big.data_ptr() + big.nbytes
        assert start - big.data_ptr() < PAGE  # from the first boundary on


def test_a_state_scatter_makes_up_the_bytes_its_tensors_lack():
    t = torch.ones(MIN_REGION + 3 * PAGE, dtype=torch.uint8)
    scatter = state_scatter([t], 2 * t.nbytes)
    assert len(scatter) == 2 * t.nbytes
    assert scatter.views(0, PAGE)[0].tobytes() == b"\x01" * PAGE  # the tensor's own memory


def test_contiguity_is_a_mean_run_of_at_least_one_page_or_unknown():
    t = torch.ones(64 * PAGE, dtype=torch.uint8)  # faulted in
    mean = contiguity(interiors([t]))
    if mean is None:  # page frames hidden from this user
        assert os.geteuid() != 0
    else:
        assert 1.0 <= mean <= 64
    assert contiguity([]) is None
