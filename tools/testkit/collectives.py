"""Count the bytes DCP's object collectives carry in this process (run it on every rank of a
:mod:`tools.testkit.world`): ``CollectiveBytes`` records them, ``save_phases`` names them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_OBJECT_COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list",
                       "all_gather_object")


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
