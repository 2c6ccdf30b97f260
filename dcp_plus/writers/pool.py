"""A persistent pool of writer worker processes, shared by every writer in the process.

Started on first use, reused by later saves, shut down by :func:`shutdown_pool` or at
interpreter exit. A worker that dies fails the job it held with :class:`WorkerError` and is
replaced on the next job.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from dcp_plus.errors import ClosedError, WorkerError
from dcp_plus.storage.fanout import gather
from dcp_plus.writers.worker import Job

log = logging.getLogger(__name__)

DEFAULT_NICE = 10
"""Workers' CPU niceness: persisting is background work, so on a machine whose cores the
training step keeps busy the workers take CPU from it only when it leaves some (2-core dev
VM, 1.2 GB every 5 steps: step overhead +8-10 % instead of +16-18 % at niceness 0)."""


def check_pool_settings(owner: str, size: int, nice: int,
                        names: tuple[str, str] = ("workers", "worker_nice")) -> None:
    """Refuse a pool size below 1 or a niceness outside 0..19, naming ``owner``'s argument."""
    if size < 1:
        raise ValueError(f"{owner} {names[0]} must be >= 1, got {size}")
    if not 0 <= nice <= 19:
        raise ValueError(f"{owner} {names[1]} must be in 0..19, got {nice}")


class _Worker:
    def __init__(self, nice: int) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcp_plus.writers.worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            start_new_session=False,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        if nice:  # set here, not by the child: it is in force before any job can reach it
            own = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, min(19, own + nice))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: Job) -> list[str]:
        try:
            self.conn.send(job)
            status, payload = self.conn.recv()
        except (EOFError, OSError) as e:
            code = self.proc.wait()
            raise WorkerError(
                f"writer worker pid {self.pid} died (exit code {code}) while writing "
                f"{job.path}; the save failed and the worker will be replaced"
            ) from e
        if status != "ok":
            raise WorkerError(f"writer worker pid {self.pid} failed writing {job.path}: {payload}")
        return payload

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.conn.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WorkerPool:
    """``size`` worker processes fed from the calling threads.

    Args:
        size: number of worker processes (each writes one job at a time).
        nice: added to the workers' CPU niceness (0 to 19; see :data:`DEFAULT_NICE`).
    """

    def __init__(self, size: int = 2, nice: int = DEFAULT_NICE) -> None:
        check_pool_settings("WorkerPool", size, nice, ("size", "nice"))
        self.size = size
        self.nice = nice
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="dcpp-pool")
        for _ in range(size):
            w = _Worker(nice)
            self._workers.append(w)
            self._idle.put(w)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers]

    def _take(self) -> _Worker:
        w = self._idle.get()
        if w.alive():
            return w
        with self._lock:
            fresh = _Worker(self.nice)
            self._workers[self._workers.index(w)] = fresh
        log.warning("replaced dead writer worker pid %d with pid %d", w.pid, fresh.pid)
        return fresh

    def _run_one(self, job: Job) -> list[str]:
        w = self._take()
        try:
            return w.run(job)
        finally:
            self._idle.put(w)

    def run(self, jobs: Sequence[Job]) -> list[list[str]]:
        """Run ``jobs`` in parallel; returns each job's extent checksums, in order.

        Raises:
            WorkerError: a worker died or failed (after every other job finished).
        """
        if self._closed:
            raise ClosedError("the writer worker pool is shut down")
        return gather([self._threads.submit(self._run_one, j) for j in jobs])

    def close(self) -> None:
        """Stop every worker and join the feeding threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        for w in self._workers:
            w.stop()


# The one process-wide pool, on purpose: DCP builds a new writer for every save (and a
# manager, the TorchTitan integration and user code may each hold their own), while worker
# processes are expensive to start and each maps the stager's slabs once. Writers borrow it;
# none owns it: ``shutdown_pool`` (also run at exit) is the only thing that stops it.
_shared: WorkerPool | None = None
_shared_lock = threading.Lock()


def shared_pool(size: int, nice: int = DEFAULT_NICE) -> WorkerPool:
    """The process-wide pool, (re)started with ``size`` workers at ``nice`` on first use."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._closed or (_shared.size, _shared.nice) != (size, nice):
            if _shared is not None:
                _shared.close()
            _shared = WorkerPool(size, nice)
        return _shared


def shutdown_pool() -> None:
    """Stop the process-wide pool; the next save starts a new one."""
    global _shared
    with _shared_lock:
        if _shared is not None:
            _shared.close()
            _shared = None


atexit.register(shutdown_pool)
