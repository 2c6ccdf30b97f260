"""dcp_plus: fast, safe checkpointing plugins for torch.distributed.checkpoint.

Public names are imported on first use: writer worker processes import this package and
must start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcp_plus._lazy import lazy_exports

_EXPORTS = {
    "CachedSavePlanner": "dcp_plus.planners",
    "CheckpointManager": "dcp_plus.manager",
    "LocalReaderOptions": "dcp_plus.manager",
    "LocalWriterOptions": "dcp_plus.manager",
    "ObjectStoreReaderOptions": "dcp_plus.manager",
    "ObjectStoreWriterOptions": "dcp_plus.manager",
    "InvalidOptionError": "dcp_plus.errors",
    "CheckpointSaveError": "dcp_plus.errors",
    "ArenaStager": "dcp_plus.stagers",
    "LocalWriter": "dcp_plus.writers",
    "LocalReader": "dcp_plus.readers",
    "NFSWriter": "dcp_plus.writers",
    "NFSReader": "dcp_plus.readers",
    "ObjectStoreWriter": "dcp_plus.writers",
    "ObjectStoreReader": "dcp_plus.readers",
    "SafeLoadPlanner": "dcp_plus.planners",
    "ZstdCodec": "dcp_plus.format",
    "BinaryPrefixes": "dcp_plus.format",
    "HexPrefixes": "dcp_plus.format",
    "RoundRobinPrefixes": "dcp_plus.format",
    "CheckpointExistsError": "dcp_plus.errors",
    "CheckpointFormatError": "dcp_plus.errors",
    "CheckpointNotFoundError": "dcp_plus.errors",
    "CorruptCheckpointError": "dcp_plus.errors",
    "DcpPlusError": "dcp_plus.errors",
    "StockCheckpointError": "dcp_plus.errors",
    "StorageError": "dcp_plus.errors",
    "UnsafeCheckpointError": "dcp_plus.errors",
    "UnsafeValueError": "dcp_plus.errors",
    "WorkerError": "dcp_plus.errors",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from dcp_plus.errors import (
        CheckpointExistsError,
        CheckpointFormatError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        CorruptCheckpointError,
        DcpPlusError,
        InvalidOptionError,
        StockCheckpointError,
        StorageError,
        UnsafeCheckpointError,
        UnsafeValueError,
        WorkerError,
    )
    from dcp_plus.format import BinaryPrefixes, HexPrefixes, RoundRobinPrefixes, ZstdCodec
    from dcp_plus.manager import (
        CheckpointManager,
        LocalReaderOptions,
        LocalWriterOptions,
        ObjectStoreReaderOptions,
        ObjectStoreWriterOptions,
    )
    from dcp_plus.planners import CachedSavePlanner, SafeLoadPlanner
    from dcp_plus.readers import LocalReader, NFSReader, ObjectStoreReader
    from dcp_plus.stagers import ArenaStager
    from dcp_plus.writers import LocalWriter, NFSWriter, ObjectStoreWriter


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
