"""``CheckpointManager``: periodic async checkpoints, commit, ``latest``, retention, resume."""

from dcp_plus.manager.handle import SaveHandle
from dcp_plus.manager.manager import CheckpointInfo, CheckpointManager
from dcp_plus.manager.options import (
    LocalReaderOptions,
    LocalWriterOptions,
    ObjectStoreReaderOptions,
    ObjectStoreWriterOptions,
)
from dcp_plus.manager.storage import register_scheme

__all__ = ["CheckpointInfo", "CheckpointManager", "LocalReaderOptions", "LocalWriterOptions",
           "ObjectStoreReaderOptions", "ObjectStoreWriterOptions", "SaveHandle",
           "register_scheme"]
