"""LocalReader: a DCP ``StorageReader`` for dcp_plus checkpoints in a local directory."""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_plus.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from dcp_plus.format.record import RECORD_NAME, Extent, decode_record
from dcp_plus.format.values import byte_view, check_loads_safely
from dcp_plus.readers.extents import check_bounds, read_coalesced, verify_checksum

BATCH_BYTES = 64 << 20
_PICKLE_PROTOCOL_BYTE = 0x80


def describe(index: MetadataIndex) -> str:
    chunk = "" if index.offset is None or not any(index.offset) else f" chunk {list(index.offset)}"
    return f"tensor {index.fqn!r}{chunk}"


def read_record(root: str) -> bytes:
    path = os.path.join(root, RECORD_NAME)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{root}: no commit record {RECORD_NAME}, so no committed checkpoint is there (an "
            "interrupted save leaves none)"
        ) from None


class LocalReader(StorageReader):
    """Parallel, checksum-verifying reader of dcp_plus checkpoints; supports resharding.

    Args:
        path: checkpoint directory.
        verify: check every extent's checksum while loading (default on).
        threads: parallel read threads.
        allow_pickle: also load checkpoints written by stock ``FileSystemWriter``, whose
            ``.metadata`` is a pickle that can run code; only for checkpoints you trust.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, threads: int = 4,
                 allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.threads = threads
        self.allow_pickle = allow_pickle
        self._stock: FileSystemReader | None = None
        self._extents: dict[MetadataIndex, Extent] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._stock = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        data = read_record(self.path)
        if data[:1] == b"{":
            return decode_record(data, os.path.join(self.path, RECORD_NAME))
        if data[:1] == bytes([_PICKLE_PROTOCOL_BYTE]):
            if not self.allow_pickle:
                raise UnsafeCheckpointError(
                    f"{self.path} was written by stock DCP (FileSystemWriter): its {RECORD_NAME} "
                    "is a pickle, and unpickling can run arbitrary code. Pass "
                    "LocalReader(path, allow_pickle=True) only if you trust this checkpoint"
                )
            self._stock = FileSystemReader(self.path)
            return self._stock.read_metadata(*args, **kwargs)
        raise CheckpointFormatError(
            f"{os.path.join(self.path, RECORD_NAME)}: neither a dcp_plus record nor a DCP pickle"
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._stock is not None:
            self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        self._extents = cast(dict[MetadataIndex, Extent], metadata.storage_data)
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    self._chunks[MetadataIndex(fqn, c.offsets)] = (md.properties.dtype, c.sizes)
        check_bounds(self.path, ((describe(i), e) for i, e in self._extents.items()))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._stock is not None:
            return self._stock.read_data(plan, planner)
        by_extent: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            by_extent[req.storage_index].append(req)
        per_file: dict[str, list[MetadataIndex]] = defaultdict(list)
        for idx in by_extent:
            per_file[self._extent(idx).file].append(idx)
        batches = []
        for name, idxs in per_file.items():
            idxs.sort(key=lambda i: self._extent(i).offset)
            batch: list[MetadataIndex] = []
            size = 0
            for i in idxs:
                batch.append(i)
                size += self._extent(i).length
                if size >= BATCH_BYTES:
                    batches.append((name, batch))
                    batch, size = [], 0
            if batch:
                batches.append((name, batch))
        with ThreadPoolExecutor(self.threads, thread_name_prefix="dcpp-read") as pool:
            futures = [pool.submit(self._read_batch, name, b, by_extent, planner)
                       for name, b in batches]
            for f in futures:
                f.result()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _extent(self, index: MetadataIndex) -> Extent:
        try:
            return self._extents[index]
        except KeyError:
            raise CheckpointFormatError(
                f"{os.path.join(self.path, RECORD_NAME)}: no extent recorded for "
                f"{describe(index)}"
            ) from None

    def _read_batch(self, name: str, batch: list[MetadataIndex],
                    by_extent: dict[MetadataIndex, list[ReadItem]], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, name)
        targets = [self._destination(i, by_extent[i], planner) for i in batch]
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                read_coalesced(fd, path, [(self._extent(i).offset, buf)
                                          for i, (buf, _) in zip(batch, targets, strict=True)])
            except EOFError as e:
                raise CorruptCheckpointError(f"{e} while reading {describe(batch[0])} and "
                                             f"{len(batch) - 1} more: truncated file") from None
        finally:
            os.close(fd)
        for index, (buf, finish) in zip(batch, targets, strict=True):
            if self.verify:
                verify_checksum(buf, self._extent(index), describe(index), self.path)
            finish()

    def _destination(self, index: MetadataIndex, reqs: list[ReadItem], planner: LoadPlanner):
        """A buffer to read the extent into and a callback that delivers it to the planner."""
        ext = self._extent(index)
        if ext.codec != "identity":
            raise CheckpointFormatError(f"{self.path}/{ext.file}: {describe(index)}: codec "
                                        f"{ext.codec!r} is not supported by this reader")
        if reqs[0].type == LoadItemType.BYTE_IO:
            raw = bytearray(ext.length)

            def deliver_bytes() -> None:
                if not self.allow_pickle:
                    check_loads_safely(index.fqn, bytes(raw))
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(raw))
            return memoryview(raw), deliver_bytes

        dtype, sizes = self._chunks[index]
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes != ext.length:
            raise CheckpointFormatError(
                f"{self.path}/{ext.file}: {describe(index)}: extent holds {ext.length} bytes, "
                f"but {dtype} {list(sizes)} needs {nbytes}")
        req = reqs[0]
        if len(reqs) == 1 and not any(req.storage_offsets) and list(req.lengths) == list(sizes):
            target = planner.resolve_tensor(req).detach()
            if (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
                    and target.numel() == math.prod(sizes) and nbytes > 0):
                view = byte_view(target)

                def deliver_direct() -> None:
                    planner.commit_tensor(req, target)
                return view, deliver_direct

        staging = torch.empty(nbytes, dtype=torch.uint8)

        def deliver_copy() -> None:
            chunk = staging.view(dtype).reshape(sizes) if nbytes else torch.empty(
                sizes, dtype=dtype)
            for r in reqs:
                src = chunk
                for dim, (start, length) in enumerate(zip(r.storage_offsets, r.lengths,
                                                          strict=True)):
                    src = src.narrow(dim, start, length)
                target = planner.resolve_tensor(r).detach()
                if target.size() != src.size():
                    raise CheckpointFormatError(
                        f"{self.path}/{ext.file}: {describe(index)}: stored region "
                        f"{list(src.size())} does not fit destination {list(target.size())}")
                target.copy_(src)
                planner.commit_tensor(r, target)
        view = byte_view(staging)
        return view, deliver_copy
