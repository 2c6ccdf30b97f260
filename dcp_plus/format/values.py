"""How stored values map to bytes: raw tensor bytes, and safely loadable non-tensor values."""

from __future__ import annotations

import io
from typing import Any, cast

import torch

from dcp_plus.errors import UnsafeValueError


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's elements (no copy)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(cast(Any, flat.numpy())).cast("B")


def check_loads_safely(fqn: str, data: bytes) -> None:
    """Refuse a serialized value that ``torch.load(weights_only=True)`` would reject."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise UnsafeValueError(
            f"value {fqn!r} does not load with torch.load(weights_only=True) "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); dcp_plus "
            "refuses to store or unpickle it. Use tensors, numbers, strings, or lists/dicts "
            "of them"
        ) from None
