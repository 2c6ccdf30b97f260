"""Memory-tier data files in ``/dev/shm`` as a restore reads them (``pread``) and as a peer
send hands them to gloo (mapped)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import torch

from dcp_plus.errors import CorruptCheckpointError
from dcp_plus.format.values import byte_view
from dcp_plus.memory.slabs import SHM_DIR, registry
from dcp_plus.tiers import names
from dcp_plus.tiers.record import TensorEntry


def _map(name: str) -> tuple[mmap.mmap, int]:
    # writable only because torch.frombuffer warns on read-only buffers; nothing writes
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED), size
    finally:
        os.close(fd)


def _missing(entry: TensorEntry, source: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: data file {entry.file} of tensor {entry.fqn!r} is gone")


def _past_end(entry: TensorEntry, source: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: tensor {entry.fqn!r} lies past the end of {entry.file}")


class MappedFiles:
    """Memory-tier data files by name, as tensors to send (the peer tier's send side).

    An own snapshot's slab that this process's stager holds is used as it is mapped there;
    any other file is mapped once, and its pages fault in as gloo's threads send them: filling
    the page tables up front (``MAP_POPULATE`` or ``MADV_POPULATE_READ``) costs as much and
    delays the first send by ~0.07 s per GiB."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[mmap.mmap | None, torch.Tensor]] = {}

    def _base(self, entry: TensorEntry, source: str) -> tuple[mmap.mmap | None, torch.Tensor]:
        base = self._open.get(entry.file)
        if base is not None:
            return base
        slab = registry.by_name(names.slab_of(entry.file) or "")
        try:
            base = None if slab is None else (None, slab.tensor())
        except ValueError:  # closed meanwhile: the link still holds the bytes
            base = None
        if base is None:
            try:
                m, size = _map(entry.file)
            except FileNotFoundError:
                raise _missing(entry, source) from None
            base = (m, torch.frombuffer(m, dtype=torch.uint8, count=size) if size else
                    torch.empty(0, dtype=torch.uint8))
        self._open[entry.file] = base
        return base

    def maps_files(self) -> bool:
        """Whether any file was mapped here (rather than found in this process's slabs)."""
        return any(m is not None for m, _ in self._open.values())

    def bytes_of(self, entry: TensorEntry, source: str) -> torch.Tensor:
        if entry.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        _, base = self._base(entry, source)
        if entry.offset + entry.nbytes > base.numel():
            raise _past_end(entry, source)
        return base[entry.offset:entry.offset + entry.nbytes]


Fill = Callable[[memoryview, int], None]
"""``fill(out, at)`` writes an entry's bytes ``[at, at + len(out))`` into ``out``."""


def memory_fill(data: torch.Tensor) -> Fill:
    """A :data:`Fill` over bytes already in this process (a received replica)."""
    view = byte_view(data) if data.numel() else memoryview(bytearray())

    def fill(out: memoryview, at: int) -> None:
        out[:] = view[at:at + len(out)]
    return fill


class SnapshotFiles:
    """Memory-tier data files read by name with ``pread`` (a restore's read side).

    ``pread`` from tmpfs copies page by page in the kernel: cheaper than mapping the
    snapshot into a restarted process (``MAP_POPULATE`` alone costs about a third of a
    copy), and the chunk it leaves in cache is hashed before it is evicted."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._fds: dict[str, tuple[int, int]] = {}  # name -> (fd, size)

    def fill_for(self, entry: TensorEntry) -> Fill:
        if entry.nbytes == 0:
            return memory_fill(torch.empty(0, dtype=torch.uint8))
        opened = self._fds.get(entry.file)
        if opened is None:
            try:
                fd = os.open(os.path.join(SHM_DIR, entry.file), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise _missing(entry, self.source) from None
            opened = self._fds[entry.file] = (fd, os.fstat(fd).st_size)
        fd, size = opened
        if entry.offset + entry.nbytes > size:
            raise _past_end(entry, self.source)

        def fill(out: memoryview, at: int) -> None:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], entry.offset + at + done)
                if n <= 0:
                    raise _past_end(entry, self.source)
                done += n
        return fill

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
