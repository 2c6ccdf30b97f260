"""Turn a save plan's items into raw byte views, refusing values that would not load safely."""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.extent import BYTESIO
from dcp_plus.format.record_checks import STORED_DTYPES
from dcp_plus.format.values import byte_view, check_loads_safely
from dcp_plus.memory.slabs import SlabRef, registry

_STORED = frozenset(STORED_DTYPES.values())


@dataclass
class ResolvedItem:
    """One plan item with its bytes; ``slab`` is set when they live in a registered slab."""

    item: WriteItem
    data: memoryview
    slab: SlabRef | None
    keepalive: object = None
    value: str | None = None
    """How a non-tensor value's bytes are read back (``Extent.value``)."""

    @property
    def fqn(self) -> str:
        return self.item.index.fqn


def tensor_bytes(tensor: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A flat byte view of ``tensor``'s elements (copying only if not contiguous on CPU)."""
    t = tensor.detach() if tensor.requires_grad else tensor
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t), t


def _raw_bytesio(planner: SavePlanner, item: WriteItem) -> bytes | None:
    """The contents of the value behind ``item`` if it is an ``io.BytesIO`` (stored raw, as
    stock DCP users expect, instead of pickled)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return None
    obj = lookup(item.index)
    return obj.getvalue() if isinstance(obj, io.BytesIO) else None


def resolve_items(plan: SavePlan, planner: SavePlanner,
                  allow_pickle: bool = False) -> list[ResolvedItem]:
    """Resolve every item of ``plan`` to bytes, in plan order.

    ``io.BytesIO`` values are stored as their raw bytes; other values as ``torch.save``
    bytes, refused unless they load with ``weights_only=True`` (or ``allow_pickle``).

    Raises:
        UnsafeValueError: a value that would need full unpickling to load.
        CheckpointFormatError: a tensor of a dtype dcp_plus does not store (quantized).
    """
    out = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            raw = _raw_bytesio(planner, item)
            if raw is not None:
                out.append(ResolvedItem(item, memoryview(raw), None, raw, BYTESIO))
                continue
            data = planner.resolve_data(item)
            assert isinstance(data, io.BytesIO)
            raw = data.getvalue()
            if not allow_pickle:
                check_loads_safely(item.index.fqn, raw)
            out.append(ResolvedItem(item, memoryview(raw), None, raw))
        else:
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            if data.dtype not in _STORED:
                raise CheckpointFormatError(
                    f"tensor {item.index.fqn!r} has dtype {data.dtype}, which dcp_plus does not "
                    "store (quantized and packed types); dequantize it or store its parts")
            ref = registry.lookup(data)
            view, keep = tensor_bytes(data)
            out.append(ResolvedItem(item, view, ref, keep))
    return out
