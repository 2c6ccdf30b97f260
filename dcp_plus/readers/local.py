"""LocalReader: a DCP ``StorageReader`` for dcp_plus checkpoints in a local directory."""

from __future__ import annotations

import os
from functools import partial
from typing import cast

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus.errors import CheckpointNotFoundError, InvalidOptionError
from dcp_plus.format.record import MAX_RECORD_BYTES, RECORD_NAME
from dcp_plus.readers.base import ExtentReader, describe
from dcp_plus.readers.solo_memory import may_shift_for
from dcp_plus.storage.direct import DirectIO, direct_io_problem
from dcp_plus.storage.direct_extents import COPIERS
from dcp_plus.storage.direct_landing import MayShift
from dcp_plus.storage.direct_store import DirectFileStore
from dcp_plus.storage.fileio import read_regular
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
        verify: check every extent's checksum while loading (default on); with direct I/O
            each extent is hashed as its bytes arrive, not in a second pass.
        threads: parallel read threads (with direct I/O: sequential requests of up to
            16 MiB in flight, and 2 more threads copying out and hashing what came in; the
            process keeps those requests' bounce buffers for its next load).
        direct_io: read data files with ``O_DIRECT``, bypassing the page cache: straight
            into contiguous CPU destination tensors of 64 KiB or more (one that is not
            4 KiB-aligned, as torch's are not, gets its bytes at its first 4 KiB boundary and
            moved down after, unless it shares memory with another tensor of the state
            dict), through small side buffers or reused aligned bounce buffers otherwise. A
            load leaves the checkpoint out of the page cache (cold files stay cold) and
            avoids the copy through it. ``"auto"``
            (default): where it helps (not on tmpfs or ramfs, whose files live in memory);
            ``True``: wherever the file system allows it; ``False``: never. A file system
            that refuses O_DIRECT gets buffered reads, with one log line saying why.
        allow_pickle: also load checkpoints written by stock ``FileSystemWriter``, whose
            ``.metadata`` is a pickle that can run code; only for checkpoints you trust.

    Raises:
        InvalidOptionError: ``direct_io`` is not True, False or ``"auto"``.
    """

    _unit = "file"

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, threads: int = 4,
                 direct_io: DirectIO = "auto", allow_pickle: bool = False) -> None:
        problem = direct_io_problem(direct_io)
        if problem is not None:
            raise InvalidOptionError(f"LocalReader(direct_io=...): {problem}")
        super().__init__(path, verify=verify, threads=threads, allow_pickle=allow_pickle)
        self.direct_io = direct_io

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return not is_url(checkpoint_id)

    def _open_store(self) -> DirectFileStore:
        return DirectFileStore(self.path, direct_io=self.direct_io)

    def _read_extents(self, by_extent: dict[MetadataIndex, list[ReadItem]],
                      planner: LoadPlanner, may_shift: MayShift | None = None) -> None:
        store = cast(DirectFileStore, self._store)
        first = next((self._extent(i).file for i in by_extent if self._extent(i).length), None)
        if first is None or not store.uses_direct(first):
            super()._read_extents(by_extent, planner, may_shift)
            return
        self._read_pipelined(partial(store.read_direct, streams=self.threads,
                                     hashed=self.verify, may_shift=may_shift),
                             by_extent, planner,
                             threads=self.threads + COPIERS)

    def _shift_check(self, planner: LoadPlanner) -> MayShift | None:
        return may_shift_for(planner)

    def _read_file(self, name: str, reads: list[tuple[int, memoryview]],
                   may_shift: MayShift | None) -> None:
        cast(DirectFileStore, self._store).read(name, reads, may_shift)

    def _location(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _record_bytes(self) -> bytes:
        return read_record(self.path)  # names a missing directory or a directory record

    def _stock_reader(self) -> StorageReader:
        return FileSystemReader(self.path)
