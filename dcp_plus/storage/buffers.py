"""Page-aligned anonymous memory for ``O_DIRECT`` transfers (torch-free): plain buffers,
huge-page transfer buffers, and pools of them kept for reuse."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator

ALIGN = 4096
"""O_DIRECT alignment of buffer addresses, file offsets and lengths (the logical block size
of every common device; a file system needing more refuses the probe and gets buffered I/O)."""


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to whole pages) of zeroed, page-aligned anonymous memory,
    private to the process (Python's default, ``MAP_SHARED``, would let a forked child and
    its parent write the same pages)."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN),
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


HUGE_PAGE = 2 << 20


def fault_in(buf: mmap.mmap) -> None:
    """Touch every page of ``buf`` now (zeroing it; ``memset`` drops the GIL), so that no
    later use pays the first-touch fault."""
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 0, len(buf))


def transfer_buffer(nbytes: int, fault: bool = True) -> mmap.mmap:
    """Zeroed, private anonymous memory of at least ``nbytes`` for O_DIRECT transfers, backed
    by transparent huge pages where the kernel gives them, faulted in now (``fault``) or
    2 MiB at a time as it is first touched (a large buffer used for a small file then costs
    only the pages it takes).

    A device request carries a bounded number of memory segments (254 on virtio-blk): from
    scattered 4 KiB pages a request tops out near 1 MiB, from 2 MiB pages at the device's
    largest (4 MiB here). Measured on this VM, 2 GiB read through 16 MiB bounce buffers
    mapped fresh: 0.6-1.2 MiB requests and 1.6-1.8x the time of the same reads into
    contiguous memory (3.9 MiB requests)."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KiB pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    if fault:
        fault_in(buf)
    return buf


_pools: weakref.WeakSet[BufferPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class BufferPool:
    """Reusable aligned buffers of ``size`` bytes; at most ``keep`` idle ones are kept, and
    none once the pool has gone unused for ``idle_s`` seconds (None: kept for good): a
    training process that loaded once should not hold a load's buffers for the whole job.
    ``make(size)`` maps a new one (default :func:`transfer_buffer`)."""

    def __init__(self, size: int, keep: int = 8, idle_s: float | None = 60.0,
                 make: Callable[[int], mmap.mmap] | None = None) -> None:
        if size % ALIGN:
            raise ValueError(f"BufferPool size must be a multiple of {ALIGN}, got {size}")
        self.size = size
        self.keep = keep
        self.idle_s = idle_s
        self._make = make or transfer_buffer
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._last_use = 0.0
        self._timer: threading.Timer | None = None
        _pools.add(self)

    @property
    def idle(self) -> int:
        """Idle buffers kept now."""
        return len(self._idle)

    @contextlib.contextmanager
    def take(self) -> Iterator[memoryview]:
        """A buffer for the duration of the ``with`` block (its contents are stale)."""
        with self._lock:
            buf = self._idle.pop() if self._idle else None
        if buf is None:
            buf = self._make(self.size)
        view = memoryview(buf)[: self.size]  # the mapping is rounded up to whole huge pages
        try:
            yield view
        finally:
            view.release()
            with self._lock:
                self._last_use = time.monotonic()
                if len(self._idle) < self.keep:
                    self._idle.append(buf)
                    buf = None
                    self._arm()
            if buf is not None:
                with contextlib.suppress(BufferError):  # a view left alive: unmapped with it
                    buf.close()

    def _after_fork(self) -> None:
        # the child shares no thread with the parent: a lock held by one of them at the fork
        # would never be released, and a timer thread is gone
        self._lock = threading.Lock()
        self._timer = None
        self._idle = []

    def _arm(self) -> None:
        # (with the lock) a timer that is not alive: none yet, fired, or lost in a fork
        if self.idle_s is not None and (self._timer is None or not self._timer.is_alive()):
            self._timer = threading.Timer(self.idle_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        assert self.idle_s is not None
        self.release_idle(older_than=self.idle_s)
        with self._lock:
            self._timer = None
            if self._idle:  # used meanwhile: look again later
                self._arm()

    def release_idle(self, older_than: float = 0.0) -> int:
        """Unmap the idle buffers unless the pool was used within ``older_than`` seconds;
        returns how many were unmapped."""
        with self._lock:
            if time.monotonic() - self._last_use < older_than:
                return 0
            idle, self._idle = self._idle, []
        for buf in idle:
            buf.close()
        return len(idle)

    @contextlib.contextmanager
    def take_addressed(self) -> Iterator[tuple[memoryview, int]]:
        """:meth:`take`, with the buffer's address (for copies made without the GIL)."""
        with self.take() as view:
            yield view, ctypes.addressof(ctypes.c_char.from_buffer(view))

    def close(self) -> None:
        """Unmap the idle buffers (new ones are mapped on next use)."""
        self.release_idle()
