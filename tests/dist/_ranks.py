"""Rank entry points for multi-process gloo tests (spawned: importable, no test imports)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def rank_state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"rank{rank}.w": torch.randn(200_000, generator=g),
            "shared.bias": torch.arange(1000, dtype=torch.float64)}


def save_two_ranks(rank: int, world: int, port: int, url: str,
                   storage_options: dict[str, Any]) -> None:
    """Each rank saves its own tensor plus a replicated one, through one ObjectStoreWriter."""
    from dcp_plus import ObjectStoreWriter

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dcp.save(rank_state(rank), storage_writer=ObjectStoreWriter(url, storage_options))
    finally:
        dist.destroy_process_group()
