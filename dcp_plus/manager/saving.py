"""The background half of a managed save: wait for the persist, then commit the bookkeeping
(``latest``, retention) or clean up, and resolve the handle."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from dcp_plus.manager.handle import SaveHandle, save_error
from dcp_plus.manager.issuing import Issued
from dcp_plus.manager.root import CheckpointRoot
from dcp_plus.schedule import SaveStats
from dcp_plus.stagers import ArenaStager

log = logging.getLogger(__name__)


class SaveHistory:
    """Stats of finished saves: ``items``, the last ``size`` (oldest first), and ``unread``,
    those the interval policy has not been told of yet (bounded as well, for a caller that
    never calls ``maybe_save``, which drains it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[SaveStats] = []
        self.unread: deque[SaveStats] = deque(maxlen=size)
        self._lock = threading.Lock()

    def record(self, stats: SaveStats) -> None:
        with self._lock:
            self.items.append(stats)
            if len(self.items) > self.size:
                del self.items[0]
        self.unread.append(stats)


def keep_and_persist(issued: Issued, phase: Callable[[str], None]
                     ) -> tuple[Exception | None, BaseException | None]:
    """Once ``issued``'s snapshot is staged, let the memory tier keep it (phase ``memory``),
    then wait for the persist (phase ``persist``; done at once when the save is not durable).

    Returns (the tier's error, the persist's error). A snapshot the tier could not keep is
    let go once the persist no longer reads it either.
    """
    wait_futures([issued.staged])
    kept_error = None
    if issued.keep is not None:
        phase("memory")
        try:
            issued.keep()
        except Exception as e:
            kept_error = e
    phase("persist")
    wait_futures([issued.upload])
    if kept_error is not None and issued.let_go is not None:
        issued.let_go()
    return kept_error, issued.upload.exception()


@dataclass(eq=False)
class Completion:
    """Finishes saves on the manager's thread."""

    root: CheckpointRoot
    history: SaveHistory
    """Where each save's stats go."""
    clock: Callable[[], float]
    phase: Callable[[str, int], None]
    """``phase(name, step)``: the manager's phase hook."""
    coordinator: bool
    """Whether this rank changes the root (advances ``latest``, retention, removes a failed
    save)."""
    lease_held: Callable[[], bool]
    """Asked before each change (a fenced manager changes nothing)."""
    keep_last: int | None
    keep_every: int | None

    def staged(self, handle: SaveHandle, f: Future[Any], stager: ArenaStager | None) -> None:
        """Callback of the snapshot's future (``stager``: ours, whose last snapshot is this
        one, for its GPU-mode timing)."""
        handle.staged_at = self.clock()
        if stager is not None:
            handle.device_copy_s = stager.device_copy_status.last_device_copy_s
        e = f.exception()
        if e is None:
            handle.staged.set_result(None)
        else:
            handle.staged.set_exception(save_error(handle.step, handle.path, e, "staging"))

    def refused(self, handle: SaveHandle, e: BaseException) -> SaveStats:
        """A save that could not start: fail its handle; returns its stats."""
        err = save_error(handle.step, handle.path, e, "staging")
        log.error("%s", err)
        handle.staged.set_exception(err)
        handle.done.set_exception(err)
        return handle.stats(False, self.clock())

    def complete(self, handle: SaveHandle, issued: Issued) -> None:
        """Wait for the snapshot and let the memory tier keep it, wait for the commit, then
        advance ``latest`` and run retention (durable saves).

        ``handle.done`` is resolved on every path, and only once the persist has ended.
        """
        step = handle.step
        upload = issued.upload
        try:
            wait_futures([handle.staged])
            # a snapshot the tier could not keep: the durable persist may still succeed,
            # and is committed
            kept_error, failure = keep_and_persist(issued, lambda p: self.phase(p, step))
            if failure is not None:
                self.failed(handle, failure)
                return
            done_at = self.clock()
            self.phase("commit", step)
            if issued.durable and self.coordinator and self.lease_held():
                self.root.write_pointer(step)
                self.root.retain(self.keep_last, self.keep_every,
                                 lambda s: self.phase("retention", s))
            if kept_error is not None:
                raise kept_error
            stats = handle.stats(True, done_at)
            self.history.record(stats)
            self.phase("done", step)
            handle.done.set_result(stats)
        except BaseException as e:  # a hook or the bookkeeping failed: still resolve done
            wait_futures([upload])
            if not handle.done.done():
                self.failed(handle, e)

    def failed(self, handle: SaveHandle, failure: BaseException) -> None:
        err = save_error(handle.step, handle.path, failure, "persisting")
        log.error("%s", err)
        try:
            if self.coordinator:  # a fenced manager deletes nothing
                self.root.remove_failed(handle.path, self.lease_held)
        finally:
            self.history.record(handle.stats(False, self.clock()))
            if not handle.done.done():
                handle.done.set_exception(err)
