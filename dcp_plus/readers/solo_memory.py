"""Which destination memory of a load belongs to one tensor alone.

A read in place (:mod:`dcp_plus.storage.direct_landing`) passes a piece's bytes through its
destination shifted by up to 4 KiB and moves them down after. Two tensors sharing memory
(tied weights, overlapping views of one buffer) would see each other's shifted bytes, so
reads shift only inside the span of a tensor of the planner's state dict that overlaps no
other; memory the planner hands out from elsewhere is read through buffers as before.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.tensor import DTensor

from dcp_plus.format.values import tensors_in
from dcp_plus.storage.direct_landing import MayShift


class _Unplaced(Exception):
    """A CPU tensor whose memory cannot be told (sparse, a wrapper subclass)."""


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a CPU tensor's elements cover (holes between strided elements included);
    None for an empty or non-CPU one."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    try:
        start = t.data_ptr() if t.layout == torch.strided else 0
    except RuntimeError:  # tensors without storage of their own refuse data_ptr
        start = 0
    if start == 0:  # wrapper subclasses answer 0: where their bytes live is unknown
        raise _Unplaced(type(t).__name__)
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def solo_spans(values: Iterable[Any]) -> list[tuple[int, int]] | None:
    """The spans of the tensors in ``values`` (and in the dicts and lists among them) that
    overlap no other's, sorted; None if the memory of one of them cannot be told (then any
    of them may share it)."""
    try:
        spans = sorted(s for v in values for t in tensors_in(v) if (s := _span(t)))
    except _Unplaced:
        return None
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(spans):  # clusters of spans that overlap, one after another
        j, end = i + 1, spans[i][1]
        while j < len(spans) and spans[j][0] < end:
            end = max(end, spans[j][1])
            j += 1
        if j == i + 1:
            out.append(spans[i])
        i = j
    return out


def may_shift_for(planner: LoadPlanner) -> MayShift | None:
    """Whether destination bytes ``[start, end)`` lie in one solo tensor of ``planner``'s
    state dict (a ``DefaultLoadPlanner``'s, flattened); None (no shifting anywhere) for a
    planner without one, or a state dict holding a tensor whose memory cannot be told."""
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return None
    spans = solo_spans(state.values())
    if spans is None:
        return None
    starts = [s for s, _ in spans]

    def may_shift(start: int, end: int) -> bool:
        i = bisect.bisect_right(starts, start) - 1
        return i >= 0 and end <= spans[i][1]
    return may_shift
