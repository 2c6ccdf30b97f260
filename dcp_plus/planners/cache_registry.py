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
from collections.abc import Callable
from typing import Any

MAX_PINNED = 16
"""Caches of unpickled planners kept alive per process (PROCESS-mode daemons)."""

_active = threading.local()  # .cache: the PlanCache of the save running on this thread
_lock = threading.Lock()
# values are PlanCache objects (not named here: the cache module imports this one)
_registry: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_pinned: OrderedDict[str, Any] = OrderedDict()


def set_active(cache: Any) -> None:
    """Record ``cache`` as the one of the save running in this thread."""
    _active.cache = cache


def active_cache() -> Any:
    """The cache :func:`set_active` recorded on this thread, if any."""
    return getattr(_active, "cache", None)


def lookup(cache_id: str) -> Any:
    """The live cache with this id in this process, if any."""
    with _lock:
        return _registry.get(cache_id)


def register(cache_id: str, make: Callable[[], Any], pin: bool) -> Any:
    """The cache with this id in this process, created by ``make()`` if needed.

    ``pin`` keeps it alive after its planner is gone: a planner unpickled into DCP's daemon
    lives for one save only, its cache must outlive it. At most :data:`MAX_PINNED` are pinned.
    """
    with _lock:
        cache = _registry.get(cache_id)
        if cache is None:
            cache = make()
            _registry[cache_id] = cache
        if pin:
            _pinned[cache_id] = cache
            _pinned.move_to_end(cache_id)
            while len(_pinned) > MAX_PINNED:
                _pinned.popitem(last=False)
        return cache
