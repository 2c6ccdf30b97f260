"""The tiers' settings, and the memory they need."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TierOptions:
    """Memory and peer tiers of a ``CheckpointManager`` (see ``docs/tiers.md``)."""

    memory_tier: bool = False
    """Keep every snapshot in ``/dev/shm`` (or ``DCPP_SHM_DIR``), where a restarted process
    of the job finds it."""
    durable_every: int = 1
    """Persist the 1st, (N+1)-th, (2N+1)-th ... save to the root as well (1: every save)."""
    job_id: str | None = None
    """Names the job's snapshots (default: derived from the root)."""
    peer_tier: bool = False
    """Also replicate each snapshot into a partner rank's shared memory."""
    ranks_per_node: int | None = None
    """Ranks per failure domain (default: torchrun's ``LOCAL_WORLD_SIZE``)."""
    partner: Callable[[int], int] | None = None
    """``partner(rank)``: who holds ``rank``'s replica (default ``rank + ranks_per_node``)."""
    state_bytes: int | None = None
    """Expected snapshot bytes per rank: the memory needed is checked at construction."""

    def __post_init__(self) -> None:
        if type(self.durable_every) is not int or self.durable_every < 1:
            raise ValueError(f"durable_every must be an integer >= 1, got {self.durable_every!r}")
        if self.peer_tier and not self.memory_tier:
            raise ValueError("peer_tier=True needs memory_tier=True (the replica is of the "
                             "memory snapshot)")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    def per_node(self) -> int:
        """``ranks_per_node``, or torchrun's local world size."""
        if self.ranks_per_node is not None:
            return self.ranks_per_node
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not env.isdigit() or int(env) < 1:
            raise ValueError("peer_tier=True: pass ranks_per_node= (or partner=); "
                             "LOCAL_WORLD_SIZE is not set")
        return int(env)


def tier_copies(peer: bool) -> int:
    """Copies of a rank's state its shared memory holds at the peak: its newest complete
    snapshot and the one being taken (the stager's two buffers, shared with the tier), and
    as many again for the partner's replicas with the peer tier."""
    return 4 if peer else 2


def tier_memory_bytes(state_bytes: int, peer: bool) -> int:
    """Shared memory one rank needs at its peak (:func:`tier_copies` x its state)."""
    return tier_copies(peer) * state_bytes
