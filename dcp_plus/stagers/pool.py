"""Pre-faulted slabs for the first snapshot.

The first ``stage()`` otherwise copies into fresh shared memory, and the kernel's first-touch
cost dominates it (on a VM 4-36x the cost of the copy itself). :class:`SlabPool` faults slabs
in ahead of time — off the trainer's thread, e.g. right after the first optimizer step (see
``ArenaStager.guard``) — and the first arena takes its slabs from the pool, shrunk to size.
"""

from __future__ import annotations

import ctypes
import logging
import threading

from dcp_plus.shm import Slab

logger = logging.getLogger(__name__)


def touch(slab: Slab) -> None:
    """Fault every page of ``slab`` in, on the calling thread only (``memset`` drops the GIL)."""
    ctypes.memset(slab.address, 0, slab.size)


class SlabPool:
    """Slabs faulted in ahead of need; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: list[Slab] = []

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the pool holds."""
        with self._lock:
            return sum(s.size for s in self._slabs)

    def fill(self, nbytes: int, slab_bytes: int) -> None:
        """Create and fault in slabs of up to ``slab_bytes`` until the pool holds ``nbytes``."""
        while (have := self.nbytes) < nbytes:
            slab = Slab(min(slab_bytes, nbytes - have))
            try:
                touch(slab)
            except BaseException:
                slab.close()
                raise
            with self._lock:
                self._slabs.append(slab)

    def take(self, size: int) -> Slab | None:
        """The smallest pooled slab of at least ``size`` bytes, shrunk to ``size``; or None."""
        with self._lock:
            fits = [s for s in self._slabs if s.size >= size]
            if not fits:
                return None
            slab = min(fits, key=lambda s: s.size)
            self._slabs.remove(slab)
        slab.shrink(size)
        return slab

    def drain(self) -> None:
        """Free every slab still pooled."""
        with self._lock:
            slabs, self._slabs = self._slabs, []
        for slab in slabs:
            slab.close()
