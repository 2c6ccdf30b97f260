"""The consistency guard: the next optimizer step waits for the snapshot in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dcp_plus.format.layout import align_up
from dcp_plus.stagers.tree import local_tensor


class GuardHandle:
    """Removes the step pre-hooks installed by :meth:`ArenaStager.guard`."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        """Uninstall the hooks; idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> GuardHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install_guard(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    synchronize: Callable[[], None],
    after_first_step: Callable[[list[torch.optim.Optimizer]], None] | None = None,
) -> GuardHandle:
    """Register ``synchronize`` as a step pre-hook on every optimizer given.

    ``after_first_step``, if given, runs once, after the first step of any of them (when the
    optimizer state exists and its size is known).
    """
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"guard() takes optimizers, got {type(opt).__name__}")

    once: list[Any] = []  # the post-hooks of after_first_step, removed once they ran
    ran = [after_first_step is None]

    def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if ran[0] and once:
            # removed here, not in the post-hook itself: torch iterates the post-hooks'
            # dict while calling them, so removing one there breaks every later hook
            for h in once:
                h.remove()
            once.clear()
        synchronize()

    handles = [opt.register_step_pre_hook(hook) for opt in opts]
    if after_first_step is not None:

        def post(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            if not ran[0]:
                ran[0] = True
                after_first_step(opts)

        once.extend(opt.register_step_post_hook(post) for opt in opts)
        handles.extend(once)
    return GuardHandle(handles)


def checkpoint_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Arena bytes a ``{model, optim}`` state dict of these optimizers' parameters will take.

    Parameters once (as model weights) plus every optimizer-state tensor, each 4 KiB-aligned
    as in the arena layout; parameters no optimizer holds and model buffers are not counted.
    """
    seen: set[int] = set()
    total = 0
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                total += align_up(max(local_tensor(p.detach()).nbytes, 1))
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        total += align_up(max(local_tensor(v).nbytes, 1))
    return total
