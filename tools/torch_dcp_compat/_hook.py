"""A ``sys.meta_path`` hook that runs an action right after a module has been executed, before
its importer sees its names. Used in child processes (see ``_boot/sitecustomize.py``).
Imports nothing heavy itself."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

DCP = "torch.distributed.checkpoint"
GATES = "torch.testing._internal.common_distributed"


def _patch_dcp() -> None:
    from tools.torch_dcp_compat.compat import apply

    apply(os.environ.get("TORCH_DCP_COMPAT_STAGER", "saver"))


def _open_gates() -> None:
    from tools.torch_dcp_compat.gates import open_gpu_gates

    open_gpu_gates()


def actions_from_env() -> dict[str, Callable[[], None]]:
    """What this process must patch, as the pytest plugin set it in the environment."""
    actions: dict[str, Callable[[], None]] = {}
    if os.environ.get("TORCH_DCP_COMPAT") == "1":
        actions[DCP] = _patch_dcp
    if os.environ.get("TORCH_DCP_COMPAT_ALLOW_CPU") == "1":
        actions[GATES] = _open_gates
    return actions


class _AfterExec(importlib.abc.Loader):
    """Delegates to the real loader; runs the action after ``exec_module``."""

    def __init__(self, inner: Any, action: Callable[[], None]) -> None:
        self._inner = inner
        self._action = action

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._action()

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, actions: dict[str, Callable[[], None]]) -> None:
        self.actions = actions

    def find_spec(self, name: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        action = self.actions.pop(name, None)  # popped: the find_spec below skips us
        if action is None:
            return None
        if not self.actions:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterExec(spec.loader, action)
        return spec


def install(actions: dict[str, Callable[[], None]] | None = None) -> None:
    """Run each action now if its module is already imported, else when it is."""
    pending = {}
    for name, action in (actions_from_env() if actions is None else actions).items():
        if name in sys.modules:
            action()
        else:
            pending[name] = action
    if pending:
        sys.meta_path.insert(0, _Finder(pending))
