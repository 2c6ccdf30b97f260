"""Rank entry points for multi-process gloo tests (run by ``tools.testkit.world.run_ranks``:
importable, no test imports)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp


def rank_state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"rank{rank}.w": torch.randn(200_000, generator=g),
            "shared.bias": torch.arange(1000, dtype=torch.float64)}


def save_two_ranks(rank: int, world: int, url: str, storage_options: dict[str, Any]) -> None:
    """Each rank saves its own tensor plus a replicated one, through one ObjectStoreWriter."""
    from dcp_plus import ObjectStoreWriter

    warnings.filterwarnings("ignore")
    dcp.save(rank_state(rank), storage_writer=ObjectStoreWriter(url, storage_options))


def manager_saves_under_prefixes(rank: int, world: int, root: str,
                                 storage_options: dict[str, Any], prefixes: list[str]) -> None:
    """Steps 1 and 2 through a CheckpointManager (keep_last=1) whose writers spread the ranks
    over ``prefixes``; step ``s`` holds ``rank_state(rank)`` plus ``s``."""
    from dcp_plus import CheckpointManager, ObjectStoreWriterOptions, RoundRobinPrefixes

    warnings.filterwarnings("ignore")
    options = ObjectStoreWriterOptions(key_prefixes=RoundRobinPrefixes(prefixes))
    with CheckpointManager(root, storage_options=storage_options, writer_options=options,
                           keep_last=1, interval=1) as m:
        for step in (1, 2):
            m.save(step, {k: v + step for k, v in rank_state(rank).items()}).result(timeout=120)
