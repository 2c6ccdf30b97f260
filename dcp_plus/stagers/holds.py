"""Which snapshots hold arena buffers, and how a hold ends.

A hold starts when ``stage()`` takes a permit (at most ``buffers`` snapshots at a time) and ends
when the staged dict dies (its ``weakref.finalize``: DCP dropped it at the end of the save),
when its staging failed, or when the save is known to be over although the dict is still
referenced (:meth:`Holds.reclaim`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dcp_plus.errors import StagingError
from dcp_plus.memory.skipped import stale_views
from dcp_plus.stagers.arena import Arena, Buffer
from dcp_plus.stagers.arenas import ArenaSet
from dcp_plus.stagers.hsdp_skip import SkipControl
from dcp_plus.stagers.waiting import wait_until

logger = logging.getLogger(__name__)


class Holds:
    """The holds of one stager; every method takes the stager's condition ``cond``."""

    def __init__(
        self, cond: threading.Condition, arenas: ArenaSet, skip: SkipControl, buffers: int
    ) -> None:
        self._cond = cond
        self._arenas = arenas
        self._skip = skip
        self.buffers = buffers
        self.held = 0  # snapshots staged or being staged and not yet persisted
        self.pending = 0  # copy jobs submitted and not finished
        self.reading = 0  # of which, jobs that may still read the live tensors
        self.gates: set[threading.Event] = set()  # start signals of those jobs
        self.error: BaseException | None = None  # of a failed job, until synchronize_staging

    def wait(
        self, pred: Callable[[], bool], timeout: float | None, reclaim: bool = True
    ) -> bool:
        """Wait until ``pred()`` (False after ``timeout``), reclaiming ended saves once."""
        after_gc = self.reclaim_ended_saves if reclaim else None
        return wait_until(self._cond, pred, timeout, lambda: self.held, after_gc)

    def acquire(self, timeout: float | None, check_open: Callable[[], None]) -> None:
        """Take a permit for one snapshot, waiting up to ``timeout`` for a buffer."""

        def free() -> bool:
            check_open()
            return self.held < self.buffers

        if not self.wait(free, timeout):
            raise StagingError(
                f"ArenaStager(buffers={self.buffers}): no buffer was released within "
                f"{timeout}s; the previous save has not finished or a staged dict is "
                "still referenced (drop it, or raise wait_timeout_s)"
            )
        with self._cond:
            self.held += 1

    def release_permit(self) -> None:
        """Give back a permit whose snapshot never got a staged dict (staging failed)."""
        with self._cond:
            self.held -= 1
            self._cond.notify_all()

    def release(self, arena: Arena, buf: Buffer, generation: int) -> None:
        """Finalizer of a staged dict: its save is over, the buffer is free again."""
        with self._cond:
            if buf.generation != generation:  # reclaimed earlier (see reclaim_ended_saves)
                return
            buf.generation += 1
            buf.consumer = None
            self._skip.released(stale_views.pop(buf.key))
            buf.in_use = False
            self.held -= 1
            self._arenas.drop_if_idle(arena)
            self._cond.notify_all()

    def pickled(self, buf: Buffer, generation: int) -> None:
        """A staged dict is being pickled: it crosses into another process (DCP's daemon)."""
        self._skip.pickled()
        with self._cond:
            if buf.generation == generation:
                buf.consumer_saves = False  # the save runs elsewhere: thread exit proves nothing

    def reclaim_ended_saves(self) -> None:
        """Free buffers whose save has ended although their staged dict is still referenced.

        A failed save keeps its staged dict alive through the exception's traceback (stored in
        the ``upload_completion`` future until the caller drops it). With ``buffers=1`` the
        next ``stage()`` would wait for it forever. With ``executor="thread"`` the save ran on
        the thread that consumed the stage future (``async_save``'s per-save executor thread,
        which exits after the save): once that thread is gone, nothing will read the buffer
        any more, so it is reused. Other consumers are never presumed done.
        """
        self.reclaim(
            lambda b: b.consumer_saves and b.consumer is not None and not b.consumer.is_alive(),
            "its consumer thread exited",
            logging.WARNING,
        )

    def reclaim(
        self, ended: Callable[[Buffer], bool], why: str, level: int = logging.INFO
    ) -> None:
        """Free every in-use buffer with a consumer whose save ``ended(buffer)`` says is over."""
        with self._cond:
            for arena in self._arenas.arenas:
                for buf in arena.buffers:
                    if buf.in_use and buf.consumer is not None and ended(buf):
                        logger.log(
                            level, "ArenaStager: the save that used a snapshot ended (%s, %s) "
                            "but its staged dict is still referenced, usually by a failed save's "
                            "exception or the save's own arguments; reusing its buffer",
                            why, buf.consumer.name,
                        )
                        buf.generation += 1  # the old dict's finalizer no longer counts
                        buf.consumer = None
                        self._skip.reclaimed(stale_views.pop(buf.key))
                        buf.in_use = False
                        self.held -= 1
            self._cond.notify_all()
