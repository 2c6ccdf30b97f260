"""Storage readers (also read stock DCP checkpoints when pickle is explicitly allowed)."""

from dcp_plus.readers.local import LocalReader

__all__ = ["LocalReader"]
