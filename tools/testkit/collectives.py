"""Spawn a gloo world on 127.0.0.1 and count the bytes DCP's object collectives carry.

``run_world(n, fn, *args)`` starts ``n`` spawned processes, initialises a gloo process group
(env://, a free port), calls ``fn(rank, world_size, *args)`` in each and returns the results by
rank. A failure on any rank raises with that rank's traceback. Spawning costs ~5 s of torch
import per process, so a test module should run all its cases in one world.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

_OBJECT_COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list",
                       "all_gather_object")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
           out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; results indexed by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"timed out after {timeout}s waiting for a rank")
                break
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


class CollectiveBytes:
    """Counts the pickled bytes this process puts into object collectives.

    Events are ``(collective, [bytes per serialized object])``: one object for
    ``gather_object``/``all_gather_object`` (this rank's contribution), one per destination rank
    for ``scatter_object_list`` and one for ``broadcast_object_list`` (on the source rank only).
    DCP's ``save`` does, in order: gather (local plans), scatter (final plans), gather (write
    results), broadcast (metadata).
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []
        self._op: str | None = None

    @contextlib.contextmanager
    def count(self) -> Iterator[CollectiveBytes]:
        """Patch the object collectives while the block runs."""
        saved = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}
        saved_ott = c10d._object_to_tensor

        def to_tensor(obj: Any, device: Any, group: Any) -> Any:
            tensor, size = saved_ott(obj, device, group)
            if self.events and self._op is not None:
                self.events[-1][1].append(int(tensor.numel()))
            return tensor, size

        def wrap(name: str) -> Callable[..., Any]:
            inner = saved[name]

            def counted(*a: Any, **kw: Any) -> Any:
                self._op = name
                self.events.append((name, []))
                try:
                    return inner(*a, **kw)
                finally:
                    self._op = None

            return counted

        try:
            for name in _OBJECT_COLLECTIVES:
                setattr(dist, name, wrap(name))
            c10d._object_to_tensor = to_tensor
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            c10d._object_to_tensor = saved_ott

    def take(self) -> list[tuple[str, list[int]]]:
        """The events so far, then forget them."""
        ev, self.events = self.events, []
        return ev


def save_phases(events: list[tuple[str, list[int]]]) -> dict[str, int]:
    """Largest per-rank payload of each DCP save collective, from one save's events."""
    names = ["plan_gather", "plan_scatter", "write_gather", "metadata_broadcast"]
    kinds = ["gather_object", "scatter_object_list", "gather_object", "broadcast_object_list"]
    out: dict[str, int] = {}
    i = 0
    for name, kind in zip(names, kinds, strict=True):
        while i < len(events) and events[i][0] != kind:
            i += 1
        if i < len(events):
            out[name] = max(events[i][1], default=0)
            i += 1
    return out
