"""Turn a save plan's items into raw byte views, refusing values that would not load safely."""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from dcp_plus.format.values import byte_view, check_loads_safely
from dcp_plus.shm import SlabRef, registry


@dataclass
class ResolvedItem:
    """One plan item with its bytes; ``slab`` is set when they live in a registered slab."""

    item: WriteItem
    data: memoryview
    slab: SlabRef | None
    keepalive: object = None

    @property
    def fqn(self) -> str:
        return self.item.index.fqn


def tensor_bytes(tensor: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A flat byte view of ``tensor``'s elements (copying only if not contiguous on CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return byte_view(t), t


def resolve_items(plan: SavePlan, planner: SavePlanner) -> list[ResolvedItem]:
    """Resolve every item of ``plan`` to bytes, in plan order."""
    out = []
    for item in plan.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw = data.getvalue()
            check_loads_safely(item.index.fqn, raw)
            out.append(ResolvedItem(item, memoryview(raw), None, raw))
        else:
            assert isinstance(data, torch.Tensor)
            ref = registry.lookup(data)
            view, keep = tensor_bytes(data)
            out.append(ResolvedItem(item, view, ref, keep))
    return out
