"""The memory a load fills, as an O_DIRECT limit can: the state's own tensors, and how
physically contiguous their pages are.

A virtual disk's request carries a bounded number of memory segments (254 on the dev VM's
virtio-blk), and the kernel merges physically adjacent pages into one. So the same reads into
4 KiB pages run at the device's rate when the pages lie in long physical runs and up to ~1.4x
slower when they are scattered (ad hoc, 8 fresh 2 GiB tensors: mean runs of 3 pages read
1.405x the huge-page rings' time, of 16-23 pages 1.06-1.23x). The state is allocated once per
benchmark run, so its pages' layout, which no reader chooses, holds for every round of it.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable

import torch

from dcp_plus.cli.bench.limits import BLOCK, Scatter
from dcp_plus.format.values import byte_view
from dcp_plus.storage.buffers import aligned_buffer, fault_in
from dcp_plus.storage.direct_read import address

MIN_REGION = 64 << 10
"""Tensors with less than this between their first and last 4 KiB boundaries are left out
(a load reads them through side buffers, not in place)."""
_PFN_MASK = (1 << 55) - 1


def interiors(tensors: Iterable[torch.Tensor]) -> list[memoryview]:
    """Each contiguous CPU tensor's bytes from its first 4 KiB boundary to its last, where
    that is at least :data:`MIN_REGION`, in the order given."""
    out = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.nbytes < MIN_REGION:
            continue
        lo = -t.data_ptr() % BLOCK
        n = (t.nbytes - lo) // BLOCK * BLOCK
        if n >= MIN_REGION:
            out.append(byte_view(t)[lo:lo + n])
    return out


def state_scatter(tensors: Iterable[torch.Tensor], nbytes: int) -> Scatter:
    """The tensors' :func:`interiors` as one buffer of at least ``nbytes``: a page-aligned
    scratch buffer makes up what they lack (their small tensors and page edges)."""
    regions = interiors(tensors)
    short = nbytes - sum(len(r) for r in regions)
    if short > 0:
        scratch = aligned_buffer(short)
        fault_in(scratch)  # before any timed read: its first touch is not the device's time
        regions.append(memoryview(scratch))
    return Scatter(regions)


def contiguity(regions: Iterable[memoryview]) -> float | None:
    """The mean length, in 4 KiB pages, of the physically contiguous runs of the pages under
    ``regions`` (from ``/proc/self/pagemap``); None where the page frames are hidden (not
    root) or a page is not present."""
    pages = runs = 0
    with open("/proc/self/pagemap", "rb") as f:
        for r in regions:
            if not len(r):
                continue
            f.seek(address(r) // BLOCK * 8)
            data = f.read(len(r) // BLOCK * 8)
            frames = [e & _PFN_MASK for e in struct.unpack(f"{len(data) // 8}Q", data)]
            if not all(frames):
                return None
            pages += len(frames)
            runs += 1 + sum(1 for a, b in itertools.pairwise(frames) if b != a + 1)
    return pages / runs if runs else None
