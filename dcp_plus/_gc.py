"""Cyclic garbage collection paused around work that builds many acyclic objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a record's millions of acyclic objects are built
    (the collections it would trigger take half of a 100,000-tensor decode's time), or while
    a writer builds its per-item bookkeeping.

    On the way out, the objects built meanwhile are moved to the oldest generation
    (``gc.freeze()`` then ``gc.unfreeze()``) before the collector is enabled again: the
    collection their allocations are owed would otherwise run at once and traverse them
    all, only to find what refcounting frees anyway. They are traversed again at the next
    full collection, as every long-lived object is.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
