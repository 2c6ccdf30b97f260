"""``ControlGroup``: the small collectives by which the ranks of one job agree on checkpoints."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


class ControlGroup:
    """A gloo group of ``ranks`` (default: the world) for checkpoint decisions.

    Saves run collectives from a background thread and gloo aborts on interleaved
    collectives, so decisions and resume agreement get this group of their own.
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.group: Any = dist.new_group(ranks=None if ranks is None else list(ranks),
                                         backend="gloo")
        self.src = dist.get_global_rank(self.group, 0)
        """The global rank of the group's rank 0, which decides."""

    def rank0_decides(self, want: bool) -> bool:
        """Rank 0's ``want``, the same on every rank."""
        flag = torch.tensor([1 if want else 0], dtype=torch.int32)
        dist.broadcast(flag, src=self.src, group=self.group)
        return bool(flag.item())

    def everyone(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def rank0_says(self, message: str | None) -> str | None:
        """Rank 0's ``message`` (e.g. why it failed), the same on every rank."""
        said = [message]
        dist.broadcast_object_list(said, src=self.src, group=self.group)
        return said[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


@contextlib.contextmanager
def quiet_if_alone(alone: bool) -> Iterator[None]:
    """Around one DCP call: when ``alone`` (a manager without a process group, on purpose),
    hides DCP's warning that ``torch.distributed`` is disabled; the process's warning filters
    are left as they were."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield
