"""dcp_plus: fast, safe checkpointing plugins for torch.distributed.checkpoint."""

from dcp_plus.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpPlusError,
    UnsafeCheckpointError,
    UnsafeValueError,
    WorkerError,
)

__all__ = [
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DcpPlusError",
    "UnsafeCheckpointError",
    "UnsafeValueError",
    "WorkerError",
]
__version__ = "0.1.0"
