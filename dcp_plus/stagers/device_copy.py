"""GPU-mode snapshots (CheckFreq's T_og): copy device -> device first, device -> host later.

When the device has room for a second copy of the snapshot, the copy engine first copies
every CUDA tensor into a reusable device buffer (a *mirror* of the arena's CUDA extents, at
HBM speed), releases the live tensors as soon as that copy has landed, and only then copies the
mirror into the page-locked slabs while training goes on. The device -> host copies are a few
large byte ranges (the mirror has the slabs' layout), not one copy per tensor.

Whether a snapshot may use the mirror is decided before every snapshot from the device's
memory, as CheckFreq does (``M_max - M > m``): the bytes the device can still hand out, less
what training allocated at its peak beyond what it holds now (the next forward's
activations), less the bytes the mirror still needs, must stay above a safety margin.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

DeviceCopy = Literal["auto", "always", "never"]
"""``ArenaStager(device_copy=...)``: ``"auto"`` uses the mirror while device memory allows,
``"always"`` whenever the state dict's CUDA tensors are on one device, ``"never"`` stages
straight to host memory."""

DEVICE_COPY_MODES: tuple[DeviceCopy, ...] = ("auto", "always", "never")

MIN_MARGIN_BYTES = 1 << 30
"""Smallest default safety margin; the default is the larger of this and 5 % of the device."""


def check_device_copy(mode: Any, name: str = "ArenaStager(device_copy=...)") -> DeviceCopy:
    """``mode`` if it is a :data:`DeviceCopy`, else a ``ValueError`` naming ``name`` and the
    choices."""
    if not isinstance(mode, str) or mode not in DEVICE_COPY_MODES:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, DEVICE_COPY_MODES))}, got {mode!r}"
        )
    return mode  # type: ignore[no-any-return]


Span = tuple[int, int, int]
"""``(slab, start, end)``: a byte range of one slab."""


@dataclass(frozen=True, slots=True)
class MirrorPlan:
    """Where the CUDA extents of an arena layout live in a device mirror.

    ``bounds[slab] = (lo, hi)``: the mirror of that slab covers slab bytes ``[lo, hi)``.
    ``runs``: the device -> host copies, maximal ranges of consecutive CUDA extents (a CPU
    extent in between splits a run; alignment padding between two CUDA extents does not).
    """

    bounds: dict[int, tuple[int, int]]
    runs: tuple[Span, ...]

    @property
    def nbytes(self) -> int:
        """Device bytes the mirror occupies."""
        return sum(hi - lo for lo, hi in self.bounds.values())


def plan_mirror(extents: Sequence[Any], on_device: Sequence[bool]) -> MirrorPlan:
    """The :class:`MirrorPlan` of ``extents`` (an arena layout's, in order) of which those with
    ``on_device[i]`` are copied through the mirror."""
    bounds: dict[int, tuple[int, int]] = {}
    runs: list[Span] = []
    open_run: list[int] | None = None  # [slab, start, end]
    for ext, dev in zip(extents, on_device, strict=True):
        if not dev or ext.nbytes == 0:
            if dev:
                continue  # an empty CUDA tensor neither extends nor splits a run
            if ext.nbytes:
                open_run = None
            continue
        start, end = ext.offset, ext.offset + ext.nbytes
        lo, hi = bounds.get(ext.slab, (start, end))
        bounds[ext.slab] = (min(lo, start), max(hi, end))
        if open_run is not None and open_run[0] == ext.slab and open_run[2] <= start:
            open_run[2] = end
        else:
            open_run = [ext.slab, start, end]
            runs.append(open_run)  # type: ignore[arg-type]
    return MirrorPlan(bounds, tuple((s, a, b) for s, a, b in runs))


def fits(spare: int, growth: int, need: int, margin: int) -> bool:
    """CheckFreq's test: after training grows back to its peak (``growth`` more bytes) and the
    mirror takes ``need`` more, at least ``margin`` of the ``spare`` bytes must be left."""
    return spare - max(0, growth) - need >= margin


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's memory as the caching allocator and the driver see it (bytes)."""

    free: int
    total: int
    reserved: int
    allocated: int
    peak_allocated: int

    @classmethod
    def read(cls, device: int) -> DeviceMemory:
        """The figures of CUDA device ``device`` now."""
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            free=int(free),
            total=int(total),
            reserved=int(torch.cuda.memory_reserved(device)),
            allocated=int(torch.cuda.memory_allocated(device)),
            peak_allocated=int(torch.cuda.max_memory_allocated(device)),
        )

    @property
    def spare(self) -> int:
        """Bytes the device can still hand out: the driver's free memory plus the allocator's
        cached blocks not in use."""
        return self.free + max(0, self.reserved - self.allocated)

    @property
    def growth(self) -> int:
        """Bytes training held at its peak beyond what is allocated now."""
        return max(0, self.peak_allocated - self.allocated)


class Mirror:
    """A device buffer with the layout of an arena's CUDA extents (see :class:`MirrorPlan`),
    and a typed view per CUDA extent (``None`` for the others).

    Zero-filled once, so the alignment padding it copies into the slabs is zeros, never stale
    device memory.
    """

    def __init__(
        self, plan: MirrorPlan, device: int, extents: Sequence[Any], on_device: Sequence[bool]
    ) -> None:
        self.plan = plan
        self.device = device
        # allocated on the caller's stream, so that once freed the memory goes back to
        # training's pool (see CopyEngine.allocate_mirror)
        self._slabs: dict[int, tuple[int, torch.Tensor]] = {
            s: (lo, torch.zeros(hi - lo, dtype=torch.uint8, device=f"cuda:{device}"))
            for s, (lo, hi) in plan.bounds.items()
        }
        self.views: list[torch.Tensor | None] = [
            self.bytes_of(e.slab, e.offset, e.offset + e.nbytes).view(e.dtype).view(e.shape)
            if dev and e.nbytes else None
            for e, dev in zip(extents, on_device, strict=True)
        ]

    @property
    def nbytes(self) -> int:
        """Device bytes held."""
        return self.plan.nbytes

    def bytes_of(self, slab: int, start: int, end: int) -> torch.Tensor:
        """The mirror's bytes standing for slab bytes ``[start, end)``."""
        lo, buf = self._slabs[slab]
        return buf[start - lo : end - lo]

    def used_on(self, stream: Any) -> None:
        """Tell the caching allocator the buffers are used on ``stream`` (they are reused only
        after its work, once freed)."""
        for _, buf in self._slabs.values():
            buf.record_stream(stream)

    def free(self) -> None:
        """Drop the device memory (back to the caching allocator, which training may reuse)."""
        self._slabs = {}
        self.views = []


@dataclass(frozen=True, slots=True)
class DeviceCopyStatus:
    """What ``ArenaStager.device_copy_status`` reports."""

    mode: DeviceCopy
    reason: str
    """Why the last snapshot did or did not go through the device buffer."""
    held_bytes: int
    """Device memory the device buffers hold now."""
    last_device_copy_s: float | None
    """The last snapshot's device -> device copy time (CheckFreq's T_g); ``None`` if it was
    copied straight to host memory."""


class DeviceCopyPolicy:
    """Decides, snapshot by snapshot, whether an arena stages through its device mirror.

    Args:
        mode: see :data:`DeviceCopy`.
        margin_bytes: device memory that must stay free after training's peak and the mirror
            (``None``: the larger of 1 GiB and 5 % of the device).
    """

    def __init__(self, mode: DeviceCopy, margin_bytes: int | None = None) -> None:
        self.mode = check_device_copy(mode)
        if margin_bytes is not None and margin_bytes < 0:
            raise ValueError(f"ArenaStager(device_margin_bytes=...) must be >= 0, got "
                             f"{margin_bytes}")
        self.margin_bytes = margin_bytes
        self.reason = "no snapshot yet"
        """Why the last snapshot did or did not use the mirror (diagnostics)."""
        self._dropped: dict[int, tuple[int, int]] = {}  # device: (peak then, mirror bytes)

    def dropped(self, device: int, nbytes: int) -> None:
        """The mirror (``nbytes``) was just freed: training's peak so far still counts it."""
        self._dropped[device] = (int(torch.cuda.max_memory_allocated(device)), nbytes)

    def allocated(self, device: int) -> None:
        """A mirror holds memory again: the peak from now on counts it as it is."""
        self._dropped.pop(device, None)

    def margin(self, mem: DeviceMemory) -> int:
        """The safety margin on a device of ``mem.total`` bytes."""
        if self.margin_bytes is not None:
            return self.margin_bytes
        return max(MIN_MARGIN_BYTES, mem.total // 20)

    def choose(self, plan: MirrorPlan, held: Mirror | None, device: int) -> bool:
        """True if this snapshot should use a mirror of ``plan`` on ``device``; ``held`` is the
        mirror the arena already holds (reused, so it needs no new memory)."""
        if self.mode == "never":
            self.reason = "device_copy='never'"
            return False
        if self.mode == "always":
            self.reason = "device_copy='always'"
            return True
        mem = DeviceMemory.read(device)
        need = plan.nbytes - (held.nbytes if held is not None else 0)
        margin = self.margin(mem)
        growth = mem.growth
        peak_then, freed = self._dropped.get(device, (-1, 0))
        if mem.peak_allocated == peak_then:  # no new peak since: it held the freed mirror
            growth -= freed
        ok = fits(mem.spare, growth, need, margin)
        self.reason = (
            f"cuda:{device}: {mem.spare >> 20} MiB spare, training's peak needs "
            f"{max(0, growth) >> 20} MiB more, the mirror {max(0, need) >> 20} MiB more, margin "
            f"{margin >> 20} MiB: {'device copy' if ok else 'host copy'}"
        )
        return ok


def flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as a flat uint8 view, or ``None`` if ``t`` is not contiguous or a lazy
    conjugate/negative view (the copy then needs the typed ``copy_``)."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return t.reshape(-1).view(torch.uint8)
