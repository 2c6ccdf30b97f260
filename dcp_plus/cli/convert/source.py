"""Reading a whole checkpoint, dcp_plus or stock DCP, into memory in one process.

The source's format is told by its commit record: dcp_plus writes JSON, stock DCP a pickle.
Loading goes through the dcp_plus reader for the location (``LocalReader``,
``ObjectStoreReader``), which hands a stock checkpoint to torch's own reader
(``FileSystemReader``, ``FsspecReader``) once pickle is allowed; every key is loaded, as DCP's
``dcp_to_torch_save`` does, by a planner that builds the state dict from the metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus._compat.torch_dcp import EmptyStateDictLoadPlanner
from dcp_plus.errors import DcpPlusError, UnsafeCheckpointError
from dcp_plus.manager.control import quiet_if_alone
from dcp_plus.manager.handle import rank_causes
from dcp_plus.manager.storage import backend_for
from dcp_plus.planners import SafeLoadPlanner
from dcp_plus.readers.locate import reader_for
from dcp_plus.storage.urls import is_url

DCP_PLUS = "dcp_plus"
STOCK = "dcp"
KIND_NAMES = {DCP_PLUS: "dcp_plus checkpoint (JSON commit record)",
              STOCK: "stock DCP checkpoint (pickled .metadata)"}

Progress = Callable[[int], object]


@dataclass
class Source:
    """An opened checkpoint: where, which format, its metadata and a reader for it."""

    path: str
    kind: str
    metadata: Metadata
    reader: StorageReader
    unpickles: bool

    def tensor_bytes(self, names: Collection[str]) -> int:
        """Bytes of its tensors ``names`` (what the progress bars count)."""
        items = self.metadata.state_dict_metadata
        return sum(md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
                   for name, md in items.items()
                   if name in names and isinstance(md, TensorStorageMetadata))


def open_source(path: str, storage_options: Mapping[str, Any], allow_pickle: bool) -> Source:
    """Open the checkpoint at ``path`` (a directory or a URL the manager takes).

    Raises:
        CheckpointNotFoundError: no commit record there.
        UnsafeCheckpointError: a stock checkpoint and ``allow_pickle`` is false.
    """
    options = storage_options if is_url(path) else None  # a local side takes none
    reader = reader_for(path, options)
    try:
        metadata = reader.read_metadata()
        kind = DCP_PLUS
    except UnsafeCheckpointError:
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{path} is a stock DCP checkpoint: its .metadata is a pickle, and unpickling "
                "can run arbitrary code. Pass --allow-pickle to convert it, only if you trust "
                "where it came from") from None
        kind = STOCK
    if allow_pickle:  # also lets values of a dcp_plus checkpoint that need unpickling load
        reader = reader_for(path, options, allow_pickle=True)
        metadata = reader.read_metadata()
    return Source(path, kind, metadata, reader, unpickles=allow_pickle)


def backend_for_source(path: str, storage_options: Mapping[str, Any]) -> Any:
    """``backend_for``, with a bad URL scheme or option reported as a user error; the
    storage options go to URLs only (one command may read a local path and write a URL)."""
    try:
        return backend_for(path, storage_options if is_url(path) else None)
    except ValueError as e:
        raise DcpPlusError(str(e)) from None


class _SafeLoadAll(SafeLoadPlanner, EmptyStateDictLoadPlanner):
    """Every key of the checkpoint; non-tensor values only as ``weights_only`` loads them."""


def _loading_planner(base: type, names: Collection[str], progress: Progress) -> Any:
    """A ``base`` planner that loads the entries ``names`` (flat names) only, keeps the state
    dict it builds and counts committed bytes."""
    class LoadAll(base):  # type: ignore[misc, valid-type]
        loaded: dict[str, Any] = {}

        def _should_include_key(self, key: str, metadata: Metadata) -> bool:
            return key in names

        def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(state_dict, *args, **kwargs)
            self.loaded = state_dict  # filled in place; dcp.load hands back a copy's keys only

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            super().commit_tensor(read_item, tensor)
            progress(tensor.numel() * tensor.element_size())
    return LoadAll()


def load_all(source: Source, names: Collection[str], progress: Progress) -> dict[str, Any]:
    """The entries ``names`` of the checkpoint (flat names, as its metadata has them) as a
    state dict nested as it was saved, on the CPU.

    Raises:
        the reader's or planner's exception (``CorruptCheckpointError`` on a checksum
        mismatch, ``UnsafeCheckpointError`` on a value that needs unpickling), unwrapped from
        DCP's ``CheckpointException``.
    """
    planner = _loading_planner(
        EmptyStateDictLoadPlanner if source.unpickles else _SafeLoadAll, names, progress)
    with quiet_if_alone(True):
        try:
            dcp.load({}, storage_reader=source.reader, planner=planner, no_dist=True)
        except CheckpointException as e:
            raise first_cause(e) from None
    return dict(planner.loaded)


def first_cause(exc: CheckpointException) -> BaseException:
    """The exception a rank raised inside DCP's ``CheckpointException``."""
    cause = rank_causes(exc)[0][1]
    return cause if cause is not exc else DcpPlusError(str(exc).splitlines()[-1])
