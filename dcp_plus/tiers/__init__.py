"""Memory and peer tiers: snapshots kept in shared memory (the job's own and a partner's), and
recovery from the fastest tier that has the newest step every rank can restore."""

from dcp_plus.tiers.options import TierOptions, tier_memory_bytes
from dcp_plus.tiers.recovery import Restore
from dcp_plus.tiers.tiers import Tiers

__all__ = ["Restore", "TierOptions", "Tiers", "tier_memory_bytes"]
