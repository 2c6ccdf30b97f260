"""Storage writers and their shared worker-process pool."""

from dcp_plus.writers.local import LocalWriter
from dcp_plus.writers.nfs import NFSWriter
from dcp_plus.writers.object_store import ObjectStoreWriter
from dcp_plus.writers.pool import shutdown_pool

__all__ = ["LocalWriter", "NFSWriter", "ObjectStoreWriter", "shutdown_pool"]
