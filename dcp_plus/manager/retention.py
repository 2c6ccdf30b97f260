"""Which committed checkpoints retention removes (a pure function, tested on its own)."""

from __future__ import annotations

from collections.abc import Iterable


def to_remove(committed: Iterable[int], keep_last: int | None,
              keep_every: int | None) -> list[int]:
    """Steps to delete, oldest first.

    Keeps the newest ``keep_last`` committed steps (all when ``None``), every step that is a
    multiple of ``keep_every``, and always the newest committed step.
    """
    steps = sorted(set(committed))
    if not steps or keep_last is None:
        return []
    keep = set(steps[-max(1, keep_last):])
    keep.add(steps[-1])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    return [s for s in steps if s not in keep]
