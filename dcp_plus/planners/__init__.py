"""Save and load planners."""

from dcp_plus.planners.cached_save import CachedSavePlanner, PlanCacheError
from dcp_plus.planners.safe_load import SafeLoadPlanner

__all__ = ["CachedSavePlanner", "PlanCacheError", "SafeLoadPlanner"]
