"""Exception hierarchy. Every message names the object (path, tensor fqn, rank) and the fix."""

from __future__ import annotations


class DcpPlusError(Exception):
    """Base class of every error raised by dcp_plus."""


class CheckpointFormatError(DcpPlusError, ValueError):
    """A commit record or data file does not follow the dcp_plus format."""


class CorruptCheckpointError(DcpPlusError):
    """Stored bytes do not match their checksum, or a data file is truncated."""


class CheckpointExistsError(DcpPlusError, FileExistsError):
    """A committed checkpoint already exists where a new one would be written."""


class CheckpointNotFoundError(DcpPlusError, FileNotFoundError):
    """No committed checkpoint (no commit record) at the given location."""


class UnsafeValueError(DcpPlusError, TypeError):
    """A non-tensor value would not load with ``torch.load(weights_only=True)``."""


class UnsafeCheckpointError(DcpPlusError):
    """Loading would require unpickling untrusted data and that was not allowed."""


class StockCheckpointError(UnsafeCheckpointError):
    """The checkpoint was written by stock DCP (a pickled record) and ``allow_pickle`` is off."""


class WorkerError(DcpPlusError, RuntimeError):
    """A writer worker process died or failed while writing."""


class StagingError(DcpPlusError, RuntimeError):
    """Snapshotting the state dict into host memory failed."""


class StaleStagingError(StagingError):
    """A save would write a staged tensor that ``ArenaStager(skip_unwritten=...)`` skipped."""


class CapacityError(DcpPlusError, MemoryError):
    """A configured memory bound (``max_bytes``) would be exceeded."""


class ClosedError(DcpPlusError, RuntimeError):
    """The object was used after ``close()``."""


class PlanCacheError(DcpPlusError, RuntimeError):
    """Ranks disagree about what the plan cache holds (caches are dropped; save again)."""


class StorageError(DcpPlusError, OSError):
    """A storage operation (object store request, remote file I/O) failed for good."""


class CheckpointSaveError(DcpPlusError, RuntimeError):
    """A managed checkpoint could not be staged, written or committed (older ones are intact)."""


class LeaseHeldError(DcpPlusError, RuntimeError):
    """Another writer holds the checkpoint root's lease (one writer per root)."""


class LeaseLostError(DcpPlusError, RuntimeError):
    """This writer's lease on its root was taken over: it may no longer write there."""


class ReadOnlyError(DcpPlusError, PermissionError):
    """A write was asked of a ``CheckpointManager(..., read_only=True)``."""


class InvalidOptionError(DcpPlusError, ValueError):
    """A setting given at construction is refused (the message names it and what it takes)."""


class UnsupportedTorchError(DcpPlusError, ImportError):
    """The installed torch lacks a (private) torch name dcp_plus relies on."""
