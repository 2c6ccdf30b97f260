"""Where a process finds plan caches: by planner id, and the one of the save on this thread.

Both are process-wide on purpose. DCP's PROCESS executor unpickles a fresh planner into its
daemon for every save, so a planner's cache cannot live on the planner: it is found by the
planner's id here (pinned, so it outlives that one-save planner). And the final metadata
broadcast is unpickled by DCP, which hands the unpickler nothing, so the cache of the save in
flight is found per thread (:func:`active_cache`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dcp_plus.planners.cache import PlanCache

MAX_PINNED = 16
"""Caches of unpickled planners kept alive per process (PROCESS-mode daemons)."""

_active = threading.local()  # .cache: the PlanCache of the save running on this thread
_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[str, PlanCache] = weakref.WeakValueDictionary()
_pinned: OrderedDict[str, PlanCache] = OrderedDict()


def set_active(cache: PlanCache) -> None:
    """Record ``cache`` as the one of the save running in this thread."""
    _active.cache = cache


def active_cache() -> PlanCache | None:
    """The cache :func:`set_active` recorded on this thread, if any."""
    return getattr(_active, "cache", None)


def lookup(cache_id: str) -> PlanCache | None:
    """The live cache with this id in this process, if any."""
    with _lock:
        return _registry.get(cache_id)


def register(cache_id: str, capacity: int, pin: bool) -> PlanCache:
    """The cache with this id in this process, created if needed.

    ``pin`` keeps it alive after its planner is gone: a planner unpickled into DCP's daemon
    lives for one save only, its cache must outlive it. At most :data:`MAX_PINNED` are pinned.
    """
    from dcp_plus.planners.cache import PlanCache

    with _lock:
        cache = _registry.get(cache_id)
        if cache is None:
            cache = PlanCache(cache_id, capacity)
            _registry[cache_id] = cache
        if pin:
            _pinned[cache_id] = cache
            _pinned.move_to_end(cache_id)
            while len(_pinned) > MAX_PINNED:
                _pinned.popitem(last=False)
        return cache
