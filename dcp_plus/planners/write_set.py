"""What this rank wrote last time, for ``ArenaStager(skip_unwritten=planner)`` (HSDP skip).

With HSDP (or any replicated DTensor / plain tensor), DCP's deduplication assigns every chunk
to one rank; the other replicas plan it but do not write it. After each successful save plan
a :class:`~dcp_plus.planners.CachedSavePlanner` that a stager asked about records

* ``tensor_fqns``: the tensor keys of this rank's flattened state dict, in order, and
* ``unwritten``: those for which this rank's *final* local plan has no write item,

and :meth:`WriteSetRecorder.unwritten` answers a stager: the fqns not written last time, if the
stager's tensor keys are exactly ``tensor_fqns``, else nothing. Recording starts at the first
query, so planners no stager asks about do no extra work.

:meth:`WriteSetRecorder.check_and_record` also runs the safety net: the stager leaves the skipped views stale
(:mod:`dcp_plus.memory.skipped`), and if the final plan of a save must write one of them (the plan
changed after staging, e.g. another rank's structure changed), the save fails with
:class:`~dcp_plus.errors.StaleStagingError` naming the tensors, and the record is dropped so the
stager copies everything in its next snapshot.

The record is one immutable :class:`WriteSet` swapped in atomically: a stager staging while a
save plans (``buffers=2``) reads either the previous or the new plan's set, and the check in
each save's ``finish_plan`` is against that save's own snapshot whichever one it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcp_plus.errors import StaleStagingError
from dcp_plus.memory.skipped import stale_views

_EMPTY: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class WriteSet:
    """One rank's tensor keys and the ones its final plan did not write."""

    tensor_fqns: tuple[str, ...]
    unwritten: frozenset[str]


def written_fqns(plan: SavePlan) -> frozenset[str]:
    """The fqns of ``plan``'s tensor write items (``BYTE_IO`` items excluded)."""
    return frozenset(i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO)


def tensor_fqns(state_dict: dict[str, Any]) -> tuple[str, ...]:
    """The keys of a flattened state dict whose values are tensors, in order."""
    return tuple(k for k, v in state_dict.items() if isinstance(v, torch.Tensor))


class WriteSetRecorder:
    """The write set of one planner instance in one process (see the module docstring)."""

    def __init__(self) -> None:
        self.recording = False  # a stager asked: record after every save
        self.last: WriteSet | None = None
        # written fqns of the last plan's item list: a hit reuses the cached list object
        self._items: list[Any] | None = None
        self._written: frozenset[str] = _EMPTY

    def written(self, plan: SavePlan) -> frozenset[str]:
        """:func:`written_fqns` of ``plan``, cached while its item list is the same object."""
        if plan.items is not self._items:
            self._written = written_fqns(plan)
            self._items = plan.items
        return self._written

    def unwritten(self, fqns: Sequence[str]) -> frozenset[str]:
        """The fqns of ``fqns`` that the last recorded save on this rank did not write.

        Empty unless ``fqns`` equals that save's tensor keys (same structure, same order); also
        empty before the first recorded save. The first call starts recording.
        """
        self.recording = True
        last = self.last
        if last is None or len(fqns) != len(last.tensor_fqns) or tuple(fqns) != last.tensor_fqns:
            return _EMPTY
        return last.unwritten

    def forget(self) -> None:
        """Drop the record: the next query returns nothing until the next save."""
        self.last = None

    def check_and_record(self, state_dict: Any, plan: SavePlan) -> None:
        """After ``finish_plan``: fail on stale staged tensors, else record the write set.

        Raises:
            StaleStagingError: the final plan writes a tensor the stager did not refresh.
        """
        if not isinstance(state_dict, dict):
            return
        if stale_views:
            written = self.written(plan) if self.recording else written_fqns(plan)
            bad = stale_views.check(state_dict, written)
            if bad:
                self.last = None
                raise StaleStagingError(_message(bad))
        if self.recording:
            fqns = tensor_fqns(state_dict)
            self.last = WriteSet(fqns, frozenset(fqns) - self.written(plan))


def _message(bad: list[str]) -> str:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    return (
        f"rank {rank}: this save's plan writes {len(bad)} tensor(s) that ArenaStager("
        f"skip_unwritten=...) did not copy into this snapshot: {shown}. The save plan changed "
        "after staging (a rank's state-dict structure or the planner settings changed), so "
        "these staged bytes are stale; nothing stale is committed. The stager copies every "
        "tensor in its next snapshot: save again."
    )


F = TypeVar("F", bound=Callable[..., SavePlan])


def records_write_set(finish_plan: F) -> F:
    """Decorate a planner's ``finish_plan`` with its ``_write_set`` recorder's check."""

    @functools.wraps(finish_plan)
    def wrapper(self: Any, new_plan: SavePlan) -> SavePlan:
        plan = finish_plan(self, new_plan)
        self._write_set.check_and_record(getattr(self, "state_dict", None), plan)
        return plan

    return wrapper  # type: ignore[return-value]
