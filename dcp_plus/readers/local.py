"""LocalReader: a DCP ``StorageReader`` for dcp_plus checkpoints in a local directory."""

from __future__ import annotations

import os

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus.errors import CheckpointNotFoundError
from dcp_plus.format.record import MAX_RECORD_BYTES, RECORD_NAME
from dcp_plus.readers.base import ExtentReader, describe
from dcp_plus.storage.fileio import read_regular
from dcp_plus.storage.localfs import LocalFileStore
from dcp_plus.storage.urls import is_url

__all__ = ["LocalReader", "describe", "read_record"]


def read_record(root: str) -> bytes:
    """The commit record's bytes: a regular file inside ``root``, of bounded size.

    Raises:
        CheckpointNotFoundError: ``root`` holds no record (or is not a directory).
        CheckpointFormatError: the record is a symlink, FIFO, device, or too large.
    """
    try:
        return read_regular(root, RECORD_NAME, MAX_RECORD_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{root}: no commit record {RECORD_NAME}, so no committed checkpoint is there (an "
            "interrupted save leaves none)"
        ) from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{root}: not a directory, so not a dcp_plus "
                                      "checkpoint") from None
    except IsADirectoryError:
        raise CheckpointNotFoundError(f"{root}: {RECORD_NAME} is a directory") from None


class LocalReader(ExtentReader):
    """Parallel, checksum-verifying reader of dcp_plus checkpoints; supports resharding.

    Args:
        path: checkpoint directory.
        verify: check every extent's checksum while loading (default on).
        threads: parallel read threads.
        allow_pickle: also load checkpoints written by stock ``FileSystemWriter``, whose
            ``.metadata`` is a pickle that can run code; only for checkpoints you trust.
    """

    _unit = "file"

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, threads: int = 4,
                 allow_pickle: bool = False) -> None:
        super().__init__(path, verify=verify, threads=threads, allow_pickle=allow_pickle)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return not is_url(checkpoint_id)

    def _open_store(self) -> LocalFileStore:
        return LocalFileStore(self.path)

    def _location(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _record_bytes(self) -> bytes:
        return read_record(self.path)  # names a missing directory or a directory record

    def _stock_reader(self) -> StorageReader:
        return FileSystemReader(self.path)
