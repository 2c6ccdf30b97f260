"""Which committed checkpoints retention removes (a pure function, tested on its own)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

References = Callable[[int], Iterable[int] | None]
"""The steps a committed step's record references (incremental bases); None: unknown (a
damaged record), so nothing may be removed on its account."""


def to_remove(committed: Iterable[int], keep_last: int | None,
              keep_every: int | None, references: References | None = None) -> list[int]:
    """Steps to delete, oldest first.

    Keeps the newest ``keep_last`` committed steps (all when ``None``), every step that is a
    multiple of ``keep_every``, always the newest committed step, and every step a kept one
    references (``references``; a record lists every checkpoint it needs, so one level is
    the whole chain). A kept step whose references are unknown keeps everything.
    """
    steps = sorted(set(committed))
    if not steps or keep_last is None:
        return []
    keep = set(steps[-max(1, keep_last):])
    keep.add(steps[-1])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    if references is not None:
        for s in sorted(keep):
            needed = references(s)
            if needed is None:
                return []
            keep.update(needed)
    return [s for s in steps if s not in keep]
