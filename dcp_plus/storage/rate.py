"""Shaped bursts: one rank's data-write budget, shared by all of its processes.

A persist writes through several worker processes and threads at once, over files of unequal
size. The cap is one token bucket in a 4 KiB ``/dev/shm`` file that every writer of the rank
maps, not the rate split into fixed per-writer shares: with shares, a writer whose files are
done leaves its share unused and a save whose bulk sits in one file runs at a fraction of the
cap; with one bucket whoever still writes gets the whole budget.

The bucket is a virtual schedule (GCRA): it holds the ``CLOCK_MONOTONIC`` time (system-wide on
Linux, so comparable between processes) at which the budget is next free. Taking ``n`` bytes
reserves ``[start, start + n / rate)`` with ``start = max(now, next free)`` under a lock
(``flock`` between processes, a mutex between threads) and waits until ``start``. Writes are
cut into grants of at most :data:`GRANT` bytes, so over any interval of ``T`` seconds at most
``rate * T + GRANT`` bytes are sent, and a persist of ``B`` bytes lasts at least
``(B - GRANT) / rate``. Idle time earns no credit: after a pause the first grant goes at once,
the next ones at the rate again. Uncapped writers get no bucket and call nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from dcp_plus.shm import SHM_DIR

GRANT = 4 << 20
"""The largest share of the budget one write takes at a time (a multiple of 4 KiB, so cut
``O_DIRECT`` writes stay aligned): a short save is shaped too."""
_PREFIX = "dcpp-"  # with the creator's pid next: memory.slabs.remove_orphans reaps leftovers

log = logging.getLogger(__name__)


def _number_problem(value: object, what: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be {what}, got {value!r}"
    if not math.isfinite(value):
        return f"must be finite, got {value!r}"
    return None


def rate_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a ``max_bytes_per_s`` setting, or None."""
    if value is None:
        return None
    problem = _number_problem(value, "a number of bytes per second or None")
    if problem is None and value <= 0:  # type: ignore[operator]
        return f"must be > 0 (None: no cap), got {value!r}"
    return problem


def stagger_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a ``stagger`` setting, or None."""
    problem = _number_problem(value, "a number of seconds")
    if problem is None and value < 0:  # type: ignore[operator]
        return f"must be >= 0, got {value!r}"
    return problem


def shaping_problem(max_bytes_per_s: object, stagger: object) -> tuple[str, str] | None:
    """``(option, what is wrong)`` for the first bad one of the two settings, or None."""
    for name, problem in (("max_bytes_per_s", rate_problem(max_bytes_per_s)),
                          ("stagger", stagger_problem(stagger))):
        if problem is not None:
            return name, problem
    return None


def check_shaping(owner: str, max_bytes_per_s: object, stagger: object) -> None:
    """Refuse a bad ``max_bytes_per_s`` or ``stagger`` with a ValueError naming ``owner``."""
    bad = shaping_problem(max_bytes_per_s, stagger)
    if bad is not None:
        raise ValueError(f"{owner} {bad[0]} {bad[1]}")


LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "MPI_LOCALRANKID")
"""Where launchers put a process's rank on its node: torchrun, SLURM's srun, Open MPI,
MPICH/Intel MPI."""


def local_rank(rank: int) -> int:
    """This process's rank on its node, from the launcher's environment; else ``rank`` modulo
    ``LOCAL_WORLD_SIZE``; else 0 (with a warning: never a global rank, whose wait would
    grow with the job)."""
    for var in LOCAL_RANK_VARIABLES:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    if per_node.isdigit() and int(per_node) > 0:
        return rank % int(per_node)
    log.warning("stagger: no local rank in the environment (%s, LOCAL_WORLD_SIZE); rank %d "
                "starts at once", ", ".join(LOCAL_RANK_VARIABLES), rank)
    return 0


def stagger_delay(stagger: float, rank: int) -> float:
    """Seconds rank ``rank`` waits before its persist: its rank on its node
    (:func:`local_rank`) times ``stagger``."""
    if not stagger:
        return 0.0
    return local_rank(rank) * stagger


@dataclass(frozen=True)
class RateLimit:
    """Where a rank's bucket is (a ``/dev/shm`` name) and its rate: what a job carries to the
    worker processes, which open it with :meth:`open`."""

    name: str
    bytes_per_s: float

    def open(self) -> Bucket:
        return Bucket(self)


class Bucket:
    """One process's handle on a shared bucket; thread-safe."""

    def __init__(self, limit: RateLimit) -> None:
        if "/" in limit.name or not limit.name.startswith(_PREFIX):
            raise ValueError(f"not a dcp_plus rate bucket: {limit.name!r}")
        self.limit = limit
        self._per_byte = 1.0 / limit.bytes_per_s
        self._fd = os.open(os.path.join(SHM_DIR, limit.name), os.O_RDWR)
        self._map = mmap.mmap(self._fd, mmap.PAGESIZE)
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Reserve ``n`` bytes of the budget; the seconds to wait before sending them."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                now = time.monotonic()
                start = max(now, struct.unpack_from("d", self._map, 0)[0])
                struct.pack_into("d", self._map, 0, start + n * self._per_byte)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return start - now

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes may be sent (callers cut writes into :data:`GRANT` pieces)."""
        wait = self.reserve(n)
        if wait > 0:
            time.sleep(wait)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


@contextlib.contextmanager
def shared_bucket(bytes_per_s: float | None) -> Iterator[Bucket | None]:
    """A new bucket of ``bytes_per_s`` for one persist, removed afterwards; None when
    uncapped. Its :attr:`Bucket.limit` opens it in other processes."""
    if bytes_per_s is None:
        yield None
        return
    limit = RateLimit(f"{_PREFIX}{os.getpid()}-rate-{uuid.uuid4().hex[:12]}", float(bytes_per_s))
    path = os.path.join(SHM_DIR, limit.name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)  # zeros: the budget is free from time 0 on
    finally:
        os.close(fd)
    try:
        bucket = limit.open()
        try:
            yield bucket
        finally:
            bucket.close()
    finally:
        os.unlink(path)

