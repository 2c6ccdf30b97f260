"""Handing a stored ``io.BytesIO`` value back to a load planner, unpickled by nobody."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from dcp_plus.format.values import RawBytesIO


def deliver_bytesio(planner: LoadPlanner, req: ReadItem, raw: bytes) -> None:
    """Load ``raw`` as the ``io.BytesIO`` value ``req`` names.

    A planner that sets ``loads_raw_bytesio`` (``SafeLoadPlanner``) receives the bytes as a
    :class:`RawBytesIO` and stores an ``io.BytesIO`` of them. Any other planner (DCP's
    ``DefaultLoadPlanner`` ``torch.load``s what it is given) receives a ``torch.save`` of an
    ``io.BytesIO`` made here, so it too ends with the value stock DCP would give.
    """
    if getattr(planner, "loads_raw_bytesio", False):
        planner.load_bytes(req, RawBytesIO(raw))
        return
    buf = io.BytesIO()
    torch.save(io.BytesIO(raw), buf)
    buf.seek(0)
    planner.load_bytes(req, buf)
