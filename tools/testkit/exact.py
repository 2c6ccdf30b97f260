"""The one bit-exact comparison of state dicts: ``assert_bit_exact(actual, expected)``."""

from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical order, as a flat uint8 tensor."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(actual: Any, expected: Any, path: str = "") -> None:
    """Structures equal; tensors of equal dtype and shape with identical bytes (NaN payloads
    and -0.0 included); other values of the same type and equal. Fails naming the path."""
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} not a tensor"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        assert torch.equal(tensor_bytes(actual), tensor_bytes(expected)), f"{where}: bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__} not a dict"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_bit_exact(actual[k], expected[k], f"{path}.{k}" if path else str(k))
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bit_exact(a, e, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, (
            f"{where}: {actual!r} != {expected!r}")
