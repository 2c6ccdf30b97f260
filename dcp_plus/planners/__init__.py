"""Save and load planners."""

from dcp_plus.planners.safe_load import SafeLoadPlanner

__all__ = ["SafeLoadPlanner"]
