"""The future ``ArenaStager.stage()`` returns, which also tells the copy engine when to start.

Right after ``stage()`` returns, ``dcp.async_save`` still has work to do on the trainer's
thread (it starts its executor thread). If the driver thread began its Python bookkeeping at
that moment, the two would contend for the GIL, and CPython lets a waiting thread in only
every ``sys.getswitchinterval()`` (5 ms): the caller's blocking time would double. So the
driver waits until the caller is done with ``stage()``'s result — an ``add_done_callback``
(``async_save``'s last step), or ``result``/``exception`` called on the thread that staged
(``async_save``'s executor thread calls ``result()`` while the caller is still starting it, so
that one does not count) — or until :data:`START_AFTER_S` has passed, whichever comes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

START_AFTER_S = 0.005
"""Longest delay before the copy starts when nobody touches the future."""


class Release:
    """Frees one snapshot's buffer when called (a no-op before the snapshot exists, or once
    the buffer was freed). Holds the buffer, never the staged dict."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.fn is not None:
            self.fn()


class StageFuture(Future[T]):
    """A ``Future`` whose first use by the caller releases the copy job (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self._owner = threading.get_ident()
        self._setter: int | None = None
        self.consumer: threading.Thread | None = None  # first other thread to wait on it
        self._sink: Callable[[threading.Thread], None] | None = None
        self.release = Release()
        self.set_running_or_notify_cancel()

    def on_consumer(self, sink: Callable[[threading.Thread], None]) -> None:
        """Call ``sink`` with the consumer thread (now if known, else when it first waits)."""
        self._sink = sink
        if self.consumer is not None:
            sink(self.consumer)

    def add_done_callback(self, fn: Any) -> None:
        super().add_done_callback(fn)
        self.go.set()

    def set_result(self, result: T) -> None:
        self._setter = threading.get_ident()  # done-callbacks run here, inside this call
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self._setter = threading.get_ident()
        super().set_exception(exception)

    def result(self, timeout: float | None = None) -> T:
        self._owner_waits()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._owner_waits()
        return super().exception(timeout)

    def _owner_waits(self) -> None:
        me = threading.get_ident()
        if me == self._owner:
            self.go.set()
        elif self.consumer is None and me != self._setter:
            # (a done-callback reading the result on the copy thread that completed the
            # future, as async_save's staging callback does, is no consumer: the save is not
            # running there)
            # async_save's executor thread: the save runs on it, so the save is over once
            # this thread has exited (see ArenaStager: reclaiming a leaked buffer)
            self.consumer = threading.current_thread()
            if self._sink is not None:
                self._sink(self.consumer)

    def wait_for_go(self) -> None:
        """Driver side: block until the caller let go of the future, or the delay passed."""
        self.go.wait(START_AFTER_S)
