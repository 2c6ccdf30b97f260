"""Storage writers, their worker-process pool and the worker process itself.

Names resolve on first use: worker processes import ``dcp_plus.writers.worker`` and must
start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcp_plus._lazy import lazy_exports

_EXPORTS = {
    "LocalWriter": ".local",
    "NFSWriter": ".nfs",
    "ObjectStoreWriter": ".object_store",
    "shutdown_pool": ".pool",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dcp_plus.writers.local import LocalWriter
    from dcp_plus.writers.nfs import NFSWriter
    from dcp_plus.writers.object_store import ObjectStoreWriter
    from dcp_plus.writers.pool import shutdown_pool

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
