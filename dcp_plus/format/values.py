"""How stored values map to bytes: raw tensor bytes, and safely loadable non-tensor values."""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch.serialization import get_safe_globals

from dcp_plus.errors import UnsafeValueError

_NUMPY_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.complex128, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})
"""Dtypes whose tensors ``.numpy()`` views directly (the others are viewed as uint8 first)."""


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, in the dicts, lists and tuples inside it too."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's elements (no copy)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    if tensor.dtype in _NUMPY_DTYPES:  # one call instead of three tensor ops (~3 us)
        return memoryview(cast(Any, tensor.numpy())).cast("B")
    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(cast(Any, flat.numpy())).cast("B")


_UNPICKLER_REASON = re.compile(r"WeightsUnpickler error:\s*(.*?)(?: Please use|\n|$)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unsafe_reason(error: Exception) -> str:
    """The one-line cause of a ``weights_only`` load failure (e.g. which global it refused).

    torch's own message starts with advice to retry with ``weights_only=False`` (and ANSI
    escapes); that advice is wrong for untrusted checkpoints, so only the cause is kept.
    """
    text = str(error)
    m = _UNPICKLER_REASON.search(text)
    reason = m.group(1) if m else (text.splitlines()[0] if text else "")
    return f"{type(error).__name__}: {_ANSI.sub('', reason).strip()}"


_REMEMBERED_BYTES = 4096
"""Values up to this size have their verdict remembered: a save checks the same few dozen
optimizer hyperparameters every time, at 0.2 ms each."""


@functools.lru_cache(maxsize=4096)
def _refusal(data: bytes, allow_list: tuple[object, ...]) -> str | None:
    """Why ``torch.load(weights_only=True)`` refuses ``data``, or None; ``allow_list`` (torch's
    user allow-list, which ``safe_globals`` blocks change) is part of the cache key only."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        return unsafe_reason(e)
    return None


def check_loads_safely(fqn: str, data: bytes) -> None:
    """Refuse a serialized value that ``torch.load(weights_only=True)`` would reject."""
    check = _refusal if len(data) <= _REMEMBERED_BYTES else _refusal.__wrapped__
    reason = check(data, tuple(get_safe_globals()))
    if reason is not None:
        raise UnsafeValueError(
            f"value {fqn!r} does not load with torch.load(weights_only=True) "
            f"({reason}); dcp_plus refuses to store or unpickle it. Use tensors, "
            "numbers, strings, io.BytesIO, or lists/dicts of them; or pass allow_pickle=True "
            "to the writer to store it anyway (it then loads only with allow_pickle=True on "
            "the reader and a planner that unpickles)")


class RawBytesIO(io.BytesIO):
    """The raw contents of a stored ``io.BytesIO`` value (not ``torch.save`` bytes), as
    handed to a load planner that declares ``loads_raw_bytesio``."""
