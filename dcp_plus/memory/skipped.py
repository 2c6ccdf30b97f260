"""Which staged tensors hold stale bytes: the process-wide record behind the HSDP staging skip.

``ArenaStager(skip_unwritten=planner)`` leaves out of a snapshot the tensors that this rank's
last save plan did not write (another replica writes them). Their arena views then still hold
an older snapshot's bytes. The stager records them here, per arena buffer (``owner``), as
``{data_ptr: fqn}``; ``CachedSavePlanner.finish_plan``, once the save's final local plan is
known, looks up every tensor it must write and fails the save if one is stale, so stale bytes
are never written. The record is keyed by address, not carried on the staged dict, because
DCP's ``save()`` re-wraps the staged dict (``_stateful_to_state_dict``) and flattens it.

An entry lives while its buffer is held by a snapshot: the stager replaces it when it stages
into the buffer and removes it when the snapshot is released (its save is over) or the buffer
is freed, so an address is never looked up after its memory could have been reused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class StaleEntry:
    """The stale views of one snapshot, and what the save of that snapshot did about them."""

    views: dict[int, str]
    """``{data_ptr of the staged local tensor: DCP fqn}`` of every view not refreshed."""
    probe: tuple[int, str]
    """One ``(data_ptr, fqn)`` of ``views``: finds out whether a state dict is this snapshot."""
    checked: bool = False
    """A ``CachedSavePlanner`` checked the final plan of this snapshot's save."""
    failed: list[str] = field(default_factory=list)
    """The fqns that check found stale (the save was failed)."""


class StaleViews:
    """Thread-safe ``owner -> StaleEntry`` map (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, StaleEntry] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)  # a racy read is fine: entries exist before the save starts

    def set(self, owner: str, views: dict[int, str]) -> None:
        """Record ``views`` as the stale views of the snapshot now in ``owner`` (may be empty)."""
        with self._lock:
            if views:
                self._entries[owner] = StaleEntry(views, next(iter(views.items())))
            else:
                self._entries.pop(owner, None)

    def get(self, owner: str) -> StaleEntry | None:
        """The entry of ``owner``, if its snapshot has stale views."""
        with self._lock:
            return self._entries.get(owner)

    def pop(self, owner: str) -> StaleEntry | None:
        """Forget ``owner`` (its snapshot was released or its buffer freed); returns its entry."""
        with self._lock:
            return self._entries.pop(owner, None)

    def check(self, state_dict: Mapping[str, object], write_fqns: Iterable[str]) -> list[str]:
        """The fqns in ``write_fqns`` whose tensor in ``state_dict`` is a stale view.

        ``state_dict`` is a save's flattened state dict and ``write_fqns`` the tensor fqns its
        final local plan writes. Marks every entry whose snapshot ``state_dict`` is as checked
        (and, if any, as failed). Cost: one set intersection, plus a lookup per entry and per
        stale fqn that must be written (normally none).
        """
        with self._lock:
            entries = list(self._entries.values())
        if not entries:
            return []
        mine = [e for e in entries if _ptr(state_dict.get(e.probe[1])) == e.probe[0]]
        if not mine:
            return []
        wanted = set(write_fqns)
        bad: list[str] = []
        for e in mine:
            stale_fqns = wanted.intersection(e.views.values())
            if stale_fqns:
                by_fqn = {f: p for p, f in e.views.items() if f in stale_fqns}
                found = sorted(f for f in stale_fqns if _ptr(state_dict.get(f)) == by_fqn[f])
                e.failed.extend(found)
                bad.extend(found)
            e.checked = True
        return sorted(set(bad))


def _ptr(value: object) -> int | None:
    """The data address of a tensor's local bytes (a DTensor's local shard), else None."""
    if not isinstance(value, torch.Tensor):
        return None
    local = value.to_local() if hasattr(value, "to_local") else value
    return int(local.data_ptr()) if local.numel() else None


stale_views = StaleViews()
"""The one process-wide record: stagers fill it, ``CachedSavePlanner`` consults it.

Process-wide on purpose: DCP hands a planner only the (re-wrapped, flattened) state dict, never
the stager that staged it, and every planner that may save a snapshot must check it (also one
not bound to the stager), so the record is found by buffer and address, not passed."""
