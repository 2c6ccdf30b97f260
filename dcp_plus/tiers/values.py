"""The non-tensor values of a memory-tier snapshot: ``torch.save`` bytes that load with
``weights_only=True`` (``io.BytesIO`` values kept as raw bytes)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from dcp_plus.format.values import check_loads_safely


def encode_values(values: Mapping[str, Any]) -> bytes:
    """``torch.save`` bytes of the non-tensor values (``io.BytesIO`` as raw bytes), refused
    unless they load with ``weights_only=True``."""
    raw = {k: torch.frombuffer(bytearray(v.getvalue()) or bytearray(1), dtype=torch.uint8)
           [: len(v.getvalue())] for k, v in values.items() if isinstance(v, io.BytesIO)}
    plain_values = {k: v for k, v in values.items() if not isinstance(v, io.BytesIO)}
    buf = io.BytesIO()
    torch.save({"values": plain_values, "bytesio": raw}, buf)
    data = buf.getvalue()
    check_loads_safely(f"memory tier's values {sorted(plain_values)[:4]}", data)
    return data


def decode_values(data: bytes) -> dict[str, Any]:
    body = torch.load(io.BytesIO(data), weights_only=True)
    out = dict(body["values"])
    out.update({k: io.BytesIO(t.numpy().tobytes()) for k, t in body["bytesio"].items()})
    return out
