"""A state dict as the memory tier sees it: DCP's flat keys, local tensors, a fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from dcp_plus._compat.torch_dcp import flatten_state_dict, local_tensor


@dataclass(slots=True)
class Flat:
    """``tensors`` (local shards, by flat key), ``values`` (every other leaf) and the
    ``mapping`` from flat keys back to their paths in the nested dict."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    mapping: dict[str, Any]
    fingerprint: str


def plain(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every ``Stateful`` value replaced by its ``state_dict()``, as DCP does."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def flatten(state: Mapping[str, Any]) -> Flat:
    """Flatten a plain state dict the way DCP does, keeping each DTensor's local shard."""
    flat, mapping = flatten_state_dict(dict(state))
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    h = hashlib.sha256()
    for key, v in flat.items():
        if isinstance(v, DTensor):
            t = local_tensor(v)
            sig = f"{key}|d|{t.dtype}|{tuple(t.shape)}|{tuple(v.shape)}|{v.placements}"
            tensors[key] = t
        elif isinstance(v, torch.Tensor):
            sig = f"{key}|t|{v.dtype}|{tuple(v.shape)}"
            tensors[key] = v
        else:
            sig = f"{key}|v"
            values[key] = v
        h.update(sig.encode("utf-8", "backslashreplace") + b"\n")
    return Flat(tensors, values, mapping, h.hexdigest()[:32])
