"""Arenas: a few large shared-memory slabs laid out as the byte image of a data file.

One arena exists per structure fingerprint (fqn, dtype, shape, stride, device of every tensor).
Its layout puts every tensor at a 4 KiB-aligned offset in DCP's flattened state-dict order, so
slabs can be written to a data file extent by extent. An arena holds one or two *buffers* (one
snapshot each); every buffer is a few :class:`~dcp_plus.memory.slabs.Slab` objects, registered in the
process-wide :data:`~dcp_plus.memory.slabs.registry` so writers can hand ``(slab, offset, length)``
descriptors to worker processes instead of copying.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dcp_plus.format.layout import ALIGNMENT, align_up
from dcp_plus.memory.slabs import Slab, registry
from dcp_plus.stagers.device_copy import Mirror, plan_mirror
from dcp_plus.stagers.pool import SlabPool

logger = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, torch.dtype, tuple[int, ...], tuple[int, ...], str], ...]
"""One ``(fqn, dtype, shape, stride, device)`` entry per tensor, in flattened order."""


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one tensor lives inside a buffer."""

    slab: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """Extents of every tensor plus the size of each slab."""

    extents: tuple[Extent, ...]
    slab_sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory one buffer of this layout occupies."""
        return sum(self.slab_sizes)


def plan_layout(fingerprint: Fingerprint, slab_bytes: int) -> Layout:
    """Pack tensors in order into slabs of about ``slab_bytes``, each extent 4 KiB-aligned.

    A tensor larger than ``slab_bytes`` gets a slab of its own size; the last slab is only as
    large as what it holds.
    """
    extents: list[Extent] = []
    sizes: list[int] = []
    cursor = 0
    for _fqn, dtype, shape, _stride, _dev in fingerprint:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        need = align_up(max(nbytes, 1))
        if not sizes or (cursor + need > slab_bytes and cursor > 0):
            if sizes:
                sizes[-1] = cursor
            sizes.append(0)
            cursor = 0
        extents.append(Extent(len(sizes) - 1, cursor, nbytes, dtype, shape))
        cursor += need
    if sizes:
        sizes[-1] = max(cursor, ALIGNMENT)
    return Layout(tuple(extents), tuple(sizes))


def _pin(slab: Slab) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(slab.address, slab.size, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of slab {slab.name} ({slab.size} B) failed: {err}")


def _unpin(slab: Slab) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(slab.address))
    if err != 0:
        logger.warning("cudaHostUnregister of slab %s failed: %s", slab.name, err)


def free_slab(slab: Slab) -> None:
    """Unregister and unlink ``slab`` now; it is unmapped when the last tensor viewing it dies
    (for example in a planner that still holds the flattened staged dict)."""
    registry.unregister(slab)
    slab.close()


@dataclass(eq=False)
class Buffer:
    """One snapshot's worth of slabs, with a cached view per tensor."""

    slabs: list[Slab]
    views: list[torch.Tensor]
    pinned: bool
    in_use: bool = False
    bases: list[torch.Tensor] = field(default_factory=list)
    generation: int = 0  # bumped when a snapshot's hold on the buffer ends or is revoked
    consumer: threading.Thread | None = None  # the thread that took the current snapshot
    consumer_saves: bool = False
    """The consumer runs the save itself (DCP's THREAD executor): its exit ends the save."""

    @classmethod
    def allocate(cls, layout: Layout, *, pin: bool, pool: SlabPool | None = None) -> Buffer:
        """Create (or take from ``pool``), map, register and optionally pin ``layout``'s slabs."""
        slabs: list[Slab] = []
        try:
            for size in layout.slab_sizes:
                slab = (pool.take(size) if pool is not None else None) or Slab(size)
                slabs.append(slab)
                registry.register(slab)
                if pin:
                    _pin(slab)
        except BaseException:
            for slab in slabs:
                if pin:
                    _unpin(slab)
                free_slab(slab)
            raise
        buf = cls(slabs=slabs, views=[], pinned=pin)
        buf.make_views(layout)
        return buf

    @property
    def key(self) -> str:
        """A name for this buffer, unique while it lives (its first slab's name)."""
        return self.slabs[0].name if self.slabs else f"empty-{id(self)}"

    def make_views(self, layout: Layout) -> None:
        """(Re)build the per-tensor views from the slabs."""
        self.bases = [s.tensor() for s in self.slabs]
        self.views = [
            self.bases[e.slab][e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            for e in layout.extents
        ]

    def views_alias_slabs(self) -> bool:
        """False when something swapped the views' storage away from the slabs."""
        return all(
            b.untyped_storage().data_ptr() == s.address
            for b, s in zip(self.bases, self.slabs, strict=True)
        )

    def prefault(self) -> None:
        """Touch every page now, so the first copy runs at memory speed."""
        for b in self.bases:
            b.zero_()

    def free(self) -> None:
        """Release every slab (see :func:`free_slab`)."""
        self.views = []
        self.bases = []
        for slab in self.slabs:
            if self.pinned:
                _unpin(slab)
            free_slab(slab)
        self.slabs = []


class Arena:
    """The slabs for one structure fingerprint: up to ``buffers`` snapshots."""

    def __init__(self, fingerprint: Fingerprint, layout: Layout, *, pin: bool) -> None:
        self.fingerprint = fingerprint
        self.layout = layout
        self.pin = pin
        self.buffers: list[Buffer] = []
        self.newest: Buffer | None = None
        """The buffer the latest snapshot was taken into."""
        self.retired = False
        self.tensor_bytes = sum(e.nbytes for e in layout.extents)
        """Bytes of tensor data one snapshot copies (alignment padding excluded)."""
        self.mirror: Mirror | None = None
        """The device mirror of GPU-mode snapshots (:mod:`~dcp_plus.stagers.device_copy`),
        shared by this arena's buffers: snapshots run one at a time."""
        self.on_device = [dev.startswith("cuda") for *_, dev in fingerprint]
        self.mirror_plan = plan_mirror(layout.extents, self.on_device)
        self.mirror_failed = False
        """The mirror could not be allocated (out of device memory): host copies from then on."""
        devices = {dev for *_, dev in fingerprint if dev.startswith("cuda")}
        self.cuda_device: int | None = (
            torch.device(devices.pop()).index or 0 if len(devices) == 1 else None
        )
        """The CUDA device of every CUDA tensor; ``None``: none, or several (no GPU mode)."""

    def drop_mirror(self) -> tuple[int, int] | None:
        """Give the device mirror's memory back, if this arena holds one; returns its
        ``(device, bytes)``."""
        if self.mirror is None:
            return None
        freed = (self.mirror.device, self.mirror.nbytes)
        self.mirror.free()
        self.mirror = None
        return freed

    @property
    def nbytes(self) -> int:
        """Shared-memory bytes currently allocated by this arena."""
        return self.layout.nbytes * len(self.buffers)

    def add_buffer(self, pool: SlabPool | None = None) -> Buffer:
        """Allocate one more buffer, with pre-faulted slabs from ``pool`` where it has them."""
        buf = Buffer.allocate(self.layout, pin=self.pin, pool=pool)
        self.buffers.append(buf)
        logger.debug(
            "arena: allocated buffer %d (%d slabs, %d bytes, %d tensors)",
            len(self.buffers),
            len(buf.slabs),
            self.layout.nbytes,
            len(self.layout.extents),
        )
        return buf

    def in_use(self) -> bool:
        """True while any buffer is held by a snapshot that has not been persisted."""
        return any(b.in_use for b in self.buffers)

    def free(self) -> None:
        """Free every buffer; call only when :meth:`in_use` is False."""
        self.drop_mirror()
        for buf in self.buffers:
            buf.free()
        self.buffers = []


def fingerprint(fqns: list[str], tensors: list[torch.Tensor]) -> Fingerprint:
    """The :data:`Fingerprint` of local ``tensors`` stored under ``fqns``."""
    return tuple(
        (f, t.dtype, tuple(t.shape), t.stride(), str(t.device))
        for f, t in zip(fqns, tensors, strict=True)
    )


def slab_names(arenas: Sequence[Arena]) -> list[str]:
    """Names of every slab in ``arenas`` (for tests and diagnostics)."""
    return [s.name for a in arenas for b in a.buffers for s in b.slabs]
