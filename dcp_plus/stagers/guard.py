"""The consistency guard: the next optimizer step waits for the snapshot in flight."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


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
) -> GuardHandle:
    """Register ``synchronize`` as a step pre-hook on every optimizer given."""
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"guard() takes optimizers, got {type(opt).__name__}")

    def hook(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        synchronize()

    return GuardHandle([opt.register_step_pre_hook(hook) for opt in opts])
