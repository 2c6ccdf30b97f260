"""Fan calls out to threads and raise the first error once every call has ended."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any, Protocol, TypeVar

A = TypeVar("A")
B = TypeVar("B")
T = TypeVar("T")


class Submitter(Protocol):
    """What :func:`fan_out` needs of a pool: ``concurrent.futures.Executor`` or
    :class:`Threads`."""

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]: ...


def gather(futures: Sequence[Future[T]]) -> list[T]:
    """Wait for every future; raise the first failed one's error (in order), else return
    their results in order. No call is still running when this returns or raises."""
    wait_all(futures)
    for f in futures:
        e = f.exception()
        if e is not None:
            raise e
    return [f.result() for f in futures]


def fan_out(fn: Callable[[A], T], items: Sequence[A], pool: Submitter) -> list[T]:
    """``[fn(x) for x in items]``, the calls run in parallel on ``pool``; see :func:`gather`.

    With one item or none, the call runs on the calling thread (no pool thread is used).
    """
    if len(items) <= 1:
        return [fn(x) for x in items]
    return gather([pool.submit(fn, x) for x in items])


def windowed(items: Iterable[A], prepare: Callable[[A], B], run: Callable[[A, B], None],
             pool: Submitter, window: int) -> None:
    """``run(x, prepare(x))`` for every ``x`` on ``pool``, at most ``window`` calls at a time;
    ``prepare(x)`` runs on this thread, in order, just before ``x`` is submitted (so what it
    opens exists only while at most ``window`` calls are under way). The first failure
    stops the submissions; it is raised once every submitted call has ended."""
    slots = threading.Semaphore(window)
    failed = threading.Event()

    def one(x: A, prepared: B) -> None:
        try:
            run(x, prepared)
        except BaseException:
            failed.set()
            raise
        finally:
            slots.release()

    futures: list[Future[None]] = []
    try:
        for x in items:
            slots.acquire()
            if failed.is_set():
                break
            futures.append(pool.submit(one, x, prepare(x)))
    except BaseException:
        wait_all(futures)  # no call may still be running when this raises
        raise
    gather(futures)


class Threads:
    """A thread pool started on first use; :meth:`close` joins it (reopened on next use)."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.size, thread_name_prefix=self.name)
        return self._pool.submit(fn, *args)

    def map(self, fn: Callable[[A], T], items: Sequence[A]) -> list[T]:
        """:func:`fan_out` on these threads."""
        return fan_out(fn, items, self)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}  # threads do not cross processes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def in_streams(streams: int, tasks: Sequence[Callable[[], None]]) -> None:
    """Run ``tasks`` on up to ``streams`` threads (the caller's among them), each thread
    taking the next task; after the first error no new task starts and it is raised once
    every thread has stopped."""
    n = min(streams, len(tasks))
    if n <= 1:
        for task in tasks:
            task()
        return
    lock = threading.Lock()
    todo = iter(tasks)
    errors: list[BaseException] = []

    def loop() -> None:
        while True:
            with lock:
                task = None if errors else next(todo, None)
            if task is None:
                return
            try:
                task()
            except BaseException as e:  # noqa: BLE001 (re-raised on the caller's thread)
                with lock:
                    errors.append(e)
                return

    threads = [threading.Thread(target=loop, name=f"dcpp-stream-{i}", daemon=True)
               for i in range(n - 1)]
    for t in threads:
        t.start()
    loop()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
