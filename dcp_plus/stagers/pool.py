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
import time

from dcp_plus.memory.slabs import Slab

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

    def prefill(self, nbytes: int, slab_bytes: int) -> None:
        """:meth:`fill`, logging how long it took; a failure is logged and empties the pool."""
        t0 = time.perf_counter()
        try:
            self.fill(nbytes, slab_bytes)
        except OSError as e:
            logger.warning("ArenaStager: pre-faulting %d bytes failed: %s", nbytes, e)
            self.drain()
            return
        logger.info(
            "ArenaStager: pre-faulted %.1f MB in %.2fs", nbytes / 1e6, time.perf_counter() - t0
        )

    def take(self, size: int) -> Slab | None:
        """A pooled slab resized to ``size`` bytes, or None when the pool is empty.

        The smallest slab that is large enough, else the largest one, grown (only the growth
        is not faulted in yet: the arena layout leaves slab ends unused, so it needs a little
        more than the estimate a pool is filled with).
        """
        with self._lock:
            if not self._slabs:
                return None
            fits = [s for s in self._slabs if s.size >= size]
            slab = min(fits, key=lambda s: s.size) if fits else max(self._slabs, key=lambda s: s.size)
            self._slabs.remove(slab)
        slab.resize(size)
        return slab

    def drain(self) -> None:
        """Free every slab still pooled."""
        with self._lock:
            slabs, self._slabs = self._slabs, []
        for slab in slabs:
            slab.close()
