"""Storage readers (also read stock DCP checkpoints when pickle is explicitly allowed)."""

from dcp_plus.readers.local import LocalReader
from dcp_plus.readers.object_store import ObjectStoreReader

__all__ = ["LocalReader", "ObjectStoreReader"]
