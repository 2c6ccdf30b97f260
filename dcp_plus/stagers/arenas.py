"""The arenas of one stager: the current structure's, and retired ones still held by a snapshot.

A structure change retires the current arena; it is freed once no snapshot holds a buffer in it.
Not thread-safe: :class:`~dcp_plus.stagers.ArenaStager` calls it holding its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dcp_plus.errors import CapacityError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.stagers.arena import Arena, Buffer, Fingerprint, plan_layout, slab_names
from dcp_plus.stagers.pool import SlabPool

logger = logging.getLogger(__name__)


class ArenaSet:
    """Arenas by structure, bounded by ``max_bytes`` of shared memory (``None``: no bound)."""

    def __init__(self, slab_bytes: int, max_bytes: int | None) -> None:
        self.slab_bytes = slab_bytes
        self.max_bytes = max_bytes
        self.arenas: list[Arena] = []
        self.current: Arena | None = None
        self.last: Arena | None = None
        """The arena of the previous snapshot (the stager's driver thread sets it)."""
        self.mirror_dropped: Callable[[int, int], None] | None = None
        """Told ``(device, bytes)`` of a device mirror freed with its retired arena."""

    @property
    def nbytes(self) -> int:
        """Shared-memory bytes held by every arena."""
        return sum(a.nbytes for a in self.arenas)

    def names(self) -> list[str]:
        """Names of every slab held."""
        return slab_names(self.arenas)

    def check_capacity(self, extra: int) -> None:
        """Raise :class:`~dcp_plus.errors.CapacityError` if ``extra`` more bytes exceed the bound."""
        if self.max_bytes is None:
            return
        held = self.nbytes
        if held + extra > self.max_bytes:
            raise CapacityError(
                f"ArenaStager: staging needs {extra} more bytes of shared memory ({held} held) "
                f"but max_bytes={self.max_bytes}; raise max_bytes, use buffers=1, or stage a "
                "smaller state dict"
            )

    def arena_for(self, fp: Fingerprint) -> Arena:
        """The arena of structure ``fp``, retiring the current one if it is another's."""
        cur = self.current
        if cur is not None and cur.fingerprint == fp:
            return cur
        if cur is not None:
            logger.info("ArenaStager: state-dict structure changed; allocating a new arena")
            cur.retired = True
            freed = cur.drop_mirror()  # snapshots of the old structure are all copied by now
            if freed is not None and self.mirror_dropped is not None:
                self.mirror_dropped(*freed)
            self.drop_if_idle(cur)
        pin = any(dev != "cpu" for *_, dev in fp) and torch.cuda.is_available()
        arena = Arena(fp, plan_layout(fp, self.slab_bytes), pin=pin)
        self.arenas = [*self.arenas, arena]
        self.current = arena
        return arena

    def take_buffer(self, fp: Fingerprint, pool: SlabPool, limit: int = 1
                    ) -> tuple[Arena, Buffer]:
        """A free buffer of ``fp``'s arena, marked in use (allocated from ``pool`` if needed).

        Buffers are taken in turn: the one the previous snapshot filled is reused only when
        the arena holds ``limit`` buffers and no other is free, so that with two buffers the
        previous snapshot survives the next one (incremental saves take XOR deltas
        against it)."""
        arena = self.arena_for(fp)
        free = [b for b in arena.buffers if not b.in_use]
        older = [b for b in free if b is not arena.newest]
        buf = older[0] if older else free[0] if free and len(arena.buffers) >= limit else None
        if buf is None:
            self.check_capacity(arena.layout.nbytes)
            buf = arena.add_buffer(pool)
            pool.drain()
        buf.in_use = True
        arena.newest = buf
        return arena, buf

    def drop_if_idle(self, arena: Arena) -> None:
        """Free ``arena`` if it is retired and no snapshot holds a buffer in it."""
        if arena.retired and not arena.in_use():
            self._drop(arena)

    def _drop(self, arena: Arena) -> None:
        for buf in arena.buffers:
            stale_views.pop(buf.key)
        if self.last is arena:
            self.last = None
        arena.free()
        self.arenas = [a for a in self.arenas if a is not arena]

    def free_all(self) -> None:
        """Free every arena, held or not (``close()``)."""
        for arena in self.arenas:
            for buf in arena.buffers:
                buf.in_use = False
                stale_views.pop(buf.key)
            arena.free()
        self.last = None
        self.arenas = []
        self.current = None
