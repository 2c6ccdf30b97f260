"""Memory and peer tiers: snapshots kept in shared memory (the job's own and a partner's), and
recovery from the fastest tier that has the newest step every rank can restore."""

from __future__ import annotations

import importlib
from typing import Any

from dcp_plus.tiers.options import TierOptions, tier_copies, tier_memory_bytes

_LAZY = {"Restore": "dcp_plus.tiers.recovery", "Tiers": "dcp_plus.tiers.tiers"}


def __getattr__(name: str) -> Any:
    # lazily, so that `dcp-plus plan` reads the memory formula without importing torch
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Restore", "TierOptions", "Tiers", "tier_copies", "tier_memory_bytes"]
