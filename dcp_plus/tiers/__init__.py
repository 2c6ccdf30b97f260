"""Memory and peer tiers: snapshots kept in shared memory (the job's own and a partner's), and
recovery from the fastest tier that has the newest step every rank can restore."""

from __future__ import annotations

from dcp_plus._lazy import lazy_exports

# lazy, so that `dcp-plus plan` reads the memory formula (options) without importing torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "Restore": ".recovery", "TierOptions": ".options", "Tiers": ".tiers",
    "tier_copies": ".options", "tier_memory_bytes": ".options"})

__all__ = ["Restore", "TierOptions", "Tiers", "tier_copies", "tier_memory_bytes"]
