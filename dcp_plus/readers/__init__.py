"""Storage readers (also read stock DCP checkpoints when pickle is explicitly allowed)."""

from dcp_plus.readers.local import LocalReader
from dcp_plus.readers.nfs import NFSReader, latest_committed, list_committed
from dcp_plus.readers.object_store import ObjectStoreReader

__all__ = ["LocalReader", "NFSReader", "ObjectStoreReader", "latest_committed", "list_committed"]
