"""State-dict traversal for staging: tensors in DCP's flattened order, everything else copied.

:func:`capture` runs inside ``stage()`` (on the trainer's thread): it walks the state dict
depth-first in insertion order, which is the order DCP's ``flatten_state_dict`` visits leaves,
keeps a reference to every tensor and deep-copies every non-tensor leaf, so later mutation of
the caller's containers or small values cannot leak into the snapshot. :func:`fill` rebuilds
the same nesting with staged tensors in place of the live ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dcp_plus.errors import StagingError

_ATOMIC = (int, float, bool, str, bytes, type(None), complex, torch.dtype, torch.device)


@dataclass(frozen=True, slots=True)
class Slot:
    """Placeholder for the ``index``-th tensor in a captured skeleton."""

    index: int


@dataclass(slots=True)
class Captured:
    """A state dict split into its structure (``skeleton``) and its tensors, in order."""

    skeleton: dict[str, Any]
    tensors: list[torch.Tensor]


def _is_dtensor(value: torch.Tensor) -> bool:
    return type(value).__name__ == "DTensor"


def capture(state_dict: Mapping[str, Any]) -> Captured:
    """Split ``state_dict`` into a skeleton and its tensors (see module docstring).

    Runs on the caller's thread, so it does as little as possible: fully qualified names are
    derived later, on the driver thread, by :func:`fqns_of`.

    Raises:
        StagingError: a tensor kind that cannot be staged (sparse, quantized, meta, ...).
    """
    tensors: list[torch.Tensor] = []
    memo: dict[int, Any] = {}
    append = tensors.append

    def walk(value: Any) -> Any:
        t = type(value)
        if t is torch.Tensor or isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
                raise StagingError(
                    f"cannot stage a {value.layout} {value.dtype} tensor on {value.device}; "
                    "only dense strided tensors are supported"
                )
            append(value)
            return Slot(len(tensors) - 1)
        if t is dict or isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if t is list:
            return [walk(v) for v in value]
        if t is tuple:
            return tuple(walk(v) for v in value)
        if isinstance(value, _ATOMIC):
            return value
        try:
            return copy.deepcopy(value, memo)
        except Exception as e:
            raise StagingError(f"cannot copy non-tensor value of type {t.__name__}: {e}") from e

    skeleton = {k: walk(v) for k, v in state_dict.items()}
    return Captured(skeleton, tensors)


def fqns_of(skeleton: Any) -> list[str]:
    """Dotted paths of every :class:`Slot` in ``skeleton``, in slot order."""
    out: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Slot):
            out.append(path)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}")

    walk(skeleton, "")
    return out


def fill(skeleton: Any, staged: list[torch.Tensor]) -> Any:
    """The skeleton with every :class:`Slot` replaced by its staged tensor."""
    if isinstance(skeleton, Slot):
        return staged[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: fill(v, staged) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [fill(v, staged) for v in skeleton]
    if type(skeleton) is tuple:
        return tuple(fill(v, staged) for v in skeleton)
    return skeleton


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are staged: a DTensor's local shard, else ``t`` itself."""
    if _is_dtensor(t):
        return t.to_local()  # type: ignore[attr-defined]
    return t


def rewrap(original: torch.Tensor, staged_local: torch.Tensor) -> torch.Tensor:
    """Give a staged local tensor the distributed wrapper ``original`` had (if any)."""
    if _is_dtensor(original):
        from torch.distributed.tensor import DTensor

        dt: Any = original
        return DTensor(staged_local, dt._spec, requires_grad=False)
    return staged_local
