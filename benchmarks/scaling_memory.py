"""The coordinator's memory during one save: tracemalloc peak and gc-tracked object counts.

Two saves are run (every rank runs both, so the collectives match); on the measured rank:

1. under ``tracemalloc``: the peak of traced memory above its level at the save's start;
2. with ``gc.get_objects()`` counts (cyclic GC off during the save, so nothing is collected
   between the counts) above the count before the save: at ``finish`` entry (the coordinator
   then holds the global plan, the metadata and every rank's write results), when the commit
   record is put (the writer's extent table and the record's bytes alive too: dcp_plus
   writers only) and after the save once garbage is collected (what the save left behind,
   e.g. a new cache entry).

The two are separate saves because counting objects allocates a list of them all, which
tracemalloc would count. :func:`held_by` counts what a planner keeps between saves.
"""

from __future__ import annotations

import collections
import gc
import tracemalloc
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor)
_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque)  # and subclasses
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _objects() -> int:
    return len(gc.get_objects())


def _count_at_finish(writer: Any, base: int, out: dict[str, int]) -> None:
    """Wrap ``writer.finish`` (and its store's record put, where it has one) to count."""
    finish = writer.finish

    def counted_finish(*args: Any, **kwargs: Any) -> Any:
        out["at_finish"] = _objects() - base
        store = getattr(writer, "_store", None)
        if store is not None:
            put = store.put

            def counted_put(name: str, *a: Any, **kw: Any) -> Any:
                if name == ".metadata":
                    out["at_record_put"] = _objects() - base
                return put(name, *a, **kw)

            store.put = counted_put
        return finish(*args, **kwargs)

    writer.finish = counted_finish


def measure_save(save: Callable[[Any], Any], make_writer: Callable[[str], Any], path: str, *,
                 measured: bool) -> dict[str, Any]:
    """Run ``save(writer)`` twice, each with a fresh ``make_writer(path + suffix)``, and return
    the measured rank's figures (``{}`` elsewhere)."""
    if not measured:
        save(make_writer(path + "_1"))
        save(make_writer(path + "_2"))
        return {}
    writer = make_writer(path + "_1")
    gc.collect()
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    save(writer)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    writer = make_writer(path + "_2")
    gc.collect()
    out: dict[str, int] = {"tracemalloc_peak_B": peak - start}
    base = _objects()
    _count_at_finish(writer, base, out)
    gc.disable()
    try:
        save(writer)
    finally:
        gc.enable()
    gc.collect()
    out["held_after"] = _objects() - base
    return out


def held_by(planner: Any) -> int:
    """gc-tracked objects reachable from ``planner`` and from its entries in DCP's class-level
    plan caches (``SavePlanner._cached_*``, keyed by class name), not counting classes,
    modules, functions or tensors (the state dict's own) and what lies behind them; objects
    of C types (``torch.Size``, torch's bindings) count but are not walked into."""
    key = getattr(planner, "_cached_plans_key", None)
    todo: list[Any] = [planner]
    for name, value in vars(SavePlanner).items():
        if name.startswith("_cached_") and isinstance(value, dict) and key in value:
            todo.append(value[key])
    seen: set[int] = set()
    count = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if gc.is_tracked(obj):
            count += 1
            if isinstance(obj, _CONTAINERS) or type(obj).__flags__ & _HEAPTYPE:
                todo.extend(gc.get_referents(obj))  # not into C objects (torch's among them)
    return count
