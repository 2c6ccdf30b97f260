"""Every private torch name dcp_plus uses, in one place (tested range: :data:`TESTED_TORCH`).

DCP's helpers live in private modules (``_nested_dict``, ``_traverse``, ``_version``,
``_fsspec_filesystem``, ``_async_process_executor``) and DTensor's fields are private
(``_local_tensor``, ``_spec``); these move between releases. Each is resolved here, with a
fallback where a public equivalent exists and otherwise a stand-in that raises
:class:`~dcp_plus.errors.UnsupportedTorchError`, naming the torch version, when it is used, so
that ``import dcp_plus`` itself never fails on another torch.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from operator import attrgetter
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from dcp_plus.errors import UnsupportedTorchError

TESTED_TORCH = "2.11 to 2.13"
"""The torch releases CI runs the suite on (the floor in pyproject.toml, and the pinned one)."""
TORCH_VERSION: tuple[int, int] = tuple(  # type: ignore[assignment]
    int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def missing(qualname: str) -> UnsupportedTorchError:
    """The error for a torch name this torch does not have."""
    return UnsupportedTorchError(
        f"dcp_plus needs {qualname}, which torch {torch.__version__} does not have; dcp_plus "
        f"is tested with torch {TESTED_TORCH}")


def private(module: str, name: str) -> Any:
    """``module.name``, or :class:`UnsupportedTorchError` naming it and this torch."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(f"{module}.{name}") from None


def _stand_in(module: str, name: str) -> Any:
    """``module.name``, or a callable that raises the clear error when used."""
    try:
        return private(module, name)
    except UnsupportedTorchError as e:
        error = e

        def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
            raise error

        return unavailable


_DCP = "torch.distributed.checkpoint"
flatten_state_dict: Callable[..., Any] = _stand_in(f"{_DCP}._nested_dict", "flatten_state_dict")
unflatten_state_dict: Callable[..., Any] = _stand_in(f"{_DCP}._nested_dict",
                                                     "unflatten_state_dict")
set_element: Callable[..., Any] = _stand_in(f"{_DCP}._traverse", "set_element")


try:
    from torch.distributed.checkpoint import _version as _dcp_version
except ImportError:  # pragma: no cover - every tested torch has it
    _dcp_version = None  # type: ignore[assignment]


def dcp_derived_version() -> str | None:
    """DCP's ``_version._derived_version`` now (``"2_3"`` selects its pre-2.4 flatten); None,
    the current flatten, where torch has no such setting."""
    return getattr(_dcp_version, "_derived_version", None)


# DTensor's fields, read without ``to_local()`` (an autograd call under grad mode, ~4 us per
# tensor on the save path); the public properties where a torch lacks the slots.
if hasattr(DTensor, "_local_tensor") and hasattr(DTensor, "_spec"):
    local_tensor: Callable[[DTensor], torch.Tensor] = attrgetter("_local_tensor")
    dtensor_spec: Callable[[DTensor], Any] = attrgetter("_spec")
else:  # pragma: no cover - no tested torch lacks them
    def local_tensor(dt: DTensor) -> torch.Tensor:
        with torch.no_grad():
            return dt.to_local()

    def dtensor_spec(dt: DTensor) -> Any:
        return types.SimpleNamespace(placements=dt.placements, mesh=dt.device_mesh)


try:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover - a torch without ShardedTensor has none to save
    class ShardedTensor:  # type: ignore[no-redef]
        """Stand-in: no value is an instance of it."""


try:  # loads every key of a checkpoint into an empty state dict
    from torch.distributed.checkpoint.default_planner import (
        _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner,
    )
except ImportError:  # pragma: no cover - every tested torch has it
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class EmptyStateDictLoadPlanner(DefaultLoadPlanner):  # type: ignore[no-redef]
        """Stand-in: raises the clear error when used."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise missing(f"{_DCP}.default_planner._EmptyStateDictLoadPlanner")


def fsspec_reader() -> type:
    """DCP's ``FsspecReader`` (imports fsspec)."""
    return private(f"{_DCP}._fsspec_filesystem", "FsspecReader")  # type: ignore[no-any-return]


def fsspec_writer() -> type:
    """DCP's ``FsspecWriter`` (imports fsspec)."""
    return private(f"{_DCP}._fsspec_filesystem", "FsspecWriter")  # type: ignore[no-any-return]


def storage_info() -> type:
    """``FileSystemWriter``'s per-item storage data class, ``filesystem._StorageInfo``."""
    return private(f"{_DCP}.filesystem", "_StorageInfo")  # type: ignore[no-any-return]


def process_daemon_class() -> Any:
    """The class whose ``_checkpointing_subprocess`` is the PROCESS executor's daemon entry
    point, or None on a torch without it."""
    try:
        cls = private(f"{_DCP}._async_process_executor", "_AsyncCheckpointProcess")
    except UnsupportedTorchError:
        return None
    return cls if "_checkpointing_subprocess" in cls.__dict__ else None


def stop_process_executor() -> None:
    """End the daemon of DCP's PROCESS executor, if this process started one: DCP keeps it in
    a module global until the interpreter exits, and dropping it runs its ``__del__``."""
    import sys

    ape = sys.modules.get(f"{_DCP}._async_process_executor")
    if ape is not None and hasattr(ape, "_CHECKPOINT_PROCESS"):
        ape._CHECKPOINT_PROCESS = None  # type: ignore[attr-defined]


DEFAULT_STAGER_REUSABLE = TORCH_VERSION >= (2, 13)
"""Whether one ``DefaultStager`` can stage more than one save. Before torch 2.13 its
``_stage`` ends with ``StateDictStager.close()``, which empties the deep-copy dispatch table,
so a second save fails with ``KeyError: <class 'type'>``."""


class ReusableDefaultStager(AsyncStager):
    """``DefaultStager(options)`` for any number of saves: the one stager where torch allows
    that (it keeps its staging buffers between saves), else a fresh one per save (what such a
    torch gives anyway, as it drops them after each save)."""

    def __init__(self, options: StagingOptions) -> None:
        self._options = options
        self._stager = DefaultStager(options)
        self._used = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._stager.should_synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        if self._used and not DEFAULT_STAGER_REUSABLE:
            self._stager.close()  # waits until the previous save is staged
            self._stager = DefaultStager(self._options)
        self._used = True
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        self._stager.synchronize_staging()

    def close(self) -> None:
        self._stager.close()
