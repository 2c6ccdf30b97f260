"""A small least-recently-used map (the plan cache's bounded maps)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A small least-recently-used map with a fixed number of entries."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"LRU capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value for ``key`` (marking it recently used), or None."""
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value for ``key`` without touching the recency order."""
        return self._data.get(key)

    def put(self, key: K, value: V) -> None:
        """Insert or refresh ``key``, evicting the least recently used entry when full."""
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> list[K]:
        """Keys, least recently used first."""
        return list(self._data)

    def clear(self) -> None:
        """Drop every entry."""
        self._data.clear()
