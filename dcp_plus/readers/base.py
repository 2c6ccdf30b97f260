"""What every dcp_plus reader shares: read planning, destination buffers, verified delivery.

Extents are grouped per data file, sorted by offset and cut into batches; a batch is read by
the subclass's :meth:`ExtentReader._fill` straight into the destination tensors (or into a
staging buffer when a stored chunk is resharded), then checksummed and handed to the planner.
Compressed extents are read into a buffer of their stored size, checksummed, and decoded
(frames in parallel) into the destination.
"""

from __future__ import annotations

import abc
import io
import math
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_plus.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StockCheckpointError,
)
from dcp_plus.format.codecs import get_codec
from dcp_plus.format.extent import BYTESIO
from dcp_plus.format.record import RECORD_NAME, Extent, decode_record, dtype_name, extent_identity
from dcp_plus.format.values import byte_view, check_loads_safely
from dcp_plus.readers.extents import (
    aligned_bytes,
    batches_by_file,
    check_digest,
    check_extent_bounds,
    describe,
    verify_checksum,
)
from dcp_plus.readers.parts_read import Siblings, check_references, needs_parts, read_parts
from dcp_plus.readers.placement import place_objects
from dcp_plus.readers.raw_bytes import deliver_bytesio
from dcp_plus.readers.refused import RefusedRecord
from dcp_plus.storage.direct_extents import ExtentEOFError
from dcp_plus.storage.direct_landing import MayShift
from dcp_plus.storage.fanout import fan_out
from dcp_plus.storage.location import StoreClient
from dcp_plus.storage.objectio import ExtentStore

BATCH_BYTES = 64 << 20
ReadExtents = Callable[[list[tuple[str, int, int]], Callable[[int], memoryview],
                        Callable[..., None], ThreadPoolExecutor], None]
"""``read_extents(extents, open_extent, done, executor)`` of an ``ExtentStore``; ``done(k)``
or ``done(k, checksum)``."""
PICKLE_PROTOCOL_BYTE = 0x80


class ExtentReader(StoreClient, StorageReader):
    """The one dcp_plus reader over a store; a subclass opens its store and names its settings.

    Subclasses implement :meth:`_open_store` and :meth:`_stock_reader`. A pickled (stock DCP) record is
    refused unless ``allow_pickle=True``; then the stock reader does the load.
    """

    _unit = "object"
    """What messages call a data file of this store."""

    def __init__(self, path: str | os.PathLike, *, verify: bool, threads: int,
                 allow_pickle: bool) -> None:
        super().__init__()
        self._set_location(path)
        self.verify = verify
        self.threads = threads
        self.allow_pickle = allow_pickle
        self._stock: StorageReader | None = None
        self._refused: Exception | None = None  # why the last read_metadata failed
        self._extents: dict[MetadataIndex, Extent] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}
        self._sibling_readers: Siblings | None = None

    # -- what a subclass provides -----------------------------------------------------------

    @abc.abstractmethod
    def _stock_reader(self) -> StorageReader:
        """DCP's own reader for this location (used only with ``allow_pickle=True``)."""

    # -- the store --------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self._set_location(checkpoint_id)
        self._stock = None
        self._drop_siblings()  # references resolve beside the checkpoint now read

    def close(self) -> None:
        """Release connections and threads (reopened on next use)."""
        self._drop_siblings()
        self._close_store()

    def _drop_siblings(self) -> None:
        if self._sibling_readers is not None:
            self._sibling_readers.close()
            self._sibling_readers = None

    def _siblings(self) -> Siblings:
        """Readers of the checkpoints beside this one that its record references."""
        if self._sibling_readers is None:
            self._sibling_readers = Siblings(self)
        return self._sibling_readers

    def _location(self, name: str) -> str:
        """How messages name data file ``name``."""
        return f"{self.path}/{name}"

    def _record_bytes(self) -> bytes:
        """The commit record's bytes; CheckpointNotFoundError when there is none."""
        data = self._store.get(RECORD_NAME)  # stores refuse objects over MAX_RECORD_BYTES
        if data is None:
            raise CheckpointNotFoundError(
                f"{self.path}: no commit record {RECORD_NAME}, so no committed checkpoint is "
                "there (an interrupted save leaves none)")
        return data

    def _check_bounds(self) -> None:
        """Raise CheckpointFormatError if an extent's file is missing or too short."""
        own = [(describe(i), e) for i, e in self._extents.items() if e.base is None]
        sizes = self._store.sizes(sorted({e.file for _, e in own}))
        check_extent_bounds(own, sizes.__getitem__, self._location)
        referenced = [(describe(i), e) for i, e in self._extents.items() if needs_parts(e)]
        if referenced:
            check_references(self, self._siblings(), referenced)

    def _fill(self, name: str, reads: list[tuple[int, memoryview]], what: str,
              may_shift: MayShift | None = None) -> None:
        """Fill each ``(offset, buffer)`` from data file ``name`` (``may_shift``: from
        :meth:`_shift_check`); ``what`` names the items.

        Raises:
            CorruptCheckpointError: the file ends before an extent does.
        """
        try:
            self._read_file(name, reads, may_shift)
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{e} while reading {what}: truncated {self._unit}") from None

    # -- StorageReader ----------------------------------------------------------------------

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, from its commit record (validated as untrusted input).

        Raises:
            DcpPlusError: why the record is refused, naming the path (no commit record, a
                stock pickle without ``allow_pickle``, an unknown version, a damaged field).
        """
        # dcp.load catches what read_metadata raises (torch 2.11 drops it, later releases keep
        # only its text) and then asks for rank-local metadata, which dcp_plus checkpoints
        # never have. That second call returns a
        # RefusedRecord of the first error, whose first use (a planner's, or set_up_storage_reader's) raises the
        # refusal; DCP reports it as this rank's failure, so the user sees our error on every
        # torch. A call without ``rank=``, or one after a successful read, raises.
        # The retry never reads again: a rank whose retry succeeded (a passing network error)
        # would plan alone while the others wait in a collective.
        refused, self._refused = self._refused, None
        if "rank" in kwargs and refused is not None:
            return RefusedRecord(refused)
        try:
            return self._read_record(*args)
        except Exception as e:
            self._refused = e
            raise

    def _read_record(self, *args: Any) -> Metadata:
        data = self._record_bytes()
        where = self._location(RECORD_NAME)
        if data[:1] == b"{":
            return decode_record(data, where)
        if data[:1] != bytes([PICKLE_PROTOCOL_BYTE]):
            raise CheckpointFormatError(f"{where}: neither a dcp_plus record nor a DCP pickle")
        if not self.allow_pickle:
            raise StockCheckpointError(
                f"{self.path} was written by stock DCP: its {RECORD_NAME} is a pickle, and "
                f"unpickling can run arbitrary code. Pass {type(self).__name__}(..., "
                "allow_pickle=True) only if you trust this checkpoint")
        self._stock = self._stock_reader()
        return self._stock.read_metadata(*args)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if isinstance(metadata, RefusedRecord):
            raise metadata.refusal
        if self._stock is not None:
            self._stock.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        self._extents = cast(dict[MetadataIndex, Extent], metadata.storage_data)
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    self._chunks[MetadataIndex(fqn, c.offsets)] = (md.properties.dtype, c.sizes)
        place_objects(self._store, self._extents, self._location(RECORD_NAME))
        self._check_bounds()

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
        parts = {i: r for i, r in by_extent.items() if needs_parts(self._extent(i))}
        may_shift = self._shift_check(planner)  # once per load: it walks the state dict
        if parts:
            by_extent = {i: r for i, r in by_extent.items() if i not in parts}
            read_parts(self, self._siblings(), parts, planner, self._dtype_name, may_shift)
        self._read_extents(by_extent, planner, may_shift)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_extents(self, by_extent: dict[MetadataIndex, list[ReadItem]],
                      planner: LoadPlanner, may_shift: MayShift | None = None) -> None:
        """Read, verify and deliver every extent of ``by_extent``: as one pipeline of requests
        where the store reads that way, else per data file in batches of up to
        ``BATCH_BYTES`` filled by :meth:`_fill` on ``threads`` threads (``may_shift``: from
        :meth:`_shift_check`, for stores that read in place)."""
        if isinstance(self._store, ExtentStore):
            self._read_pipelined(self._store.read_extents, by_extent, planner)
            return
        batches = batches_by_file(by_extent, self._extent, BATCH_BYTES)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="dcpp-read") as pool:
            fan_out(lambda batch: self._read_batch(*batch, by_extent, planner), batches, pool)

    def _read_pipelined(self, read_extents: ReadExtents,
                        by_extent: dict[MetadataIndex, list[ReadItem]],
                        planner: LoadPlanner, threads: int | None = None) -> None:
        # One pipeline over all the objects or files: ranged GETs aligned to range_size run
        # `concurrency` at a time in order (LocalReader's O_DIRECT reads: `threads` at a
        # time); an extent's destination is resolved just before its first request starts,
        # and it is verified and delivered on one of `threads` threads as soon as its last
        # request is in. No per-batch barriers, no batch-boundary fragments.
        indexes = sorted(by_extent, key=lambda i: (self._extent(i).file, self._extent(i).offset))
        extents = [self._extent(i) for i in indexes]
        opened: dict[int, tuple[memoryview, Callable[[], None]]] = {}

        def open_extent(k: int) -> memoryview:
            opened[k] = self._destination(indexes[k], by_extent[indexes[k]], planner)
            return opened[k][0]

        def done(k: int, checksum: str | None = None) -> None:
            buf, finish = opened.pop(k)
            self._deliver(indexes[k], buf, finish, checksum)

        for k, e in enumerate(extents):
            if not e.length:  # nothing to fetch
                open_extent(k)
                done(k)
        with ThreadPoolExecutor(threads or self.threads, thread_name_prefix="dcpp-read") as pool:
            try:
                read_extents([(e.file, e.offset, e.length) for e in extents], open_extent,
                             done, pool)
            except EOFError as e:
                what = f" while reading {describe(indexes[e.extent])}" if isinstance(
                    e, ExtentEOFError) else ""
                raise CorruptCheckpointError(f"{e}{what}: truncated {self._unit}") from None

    # -- shared machinery -------------------------------------------------------------------

    def _extent(self, index: MetadataIndex) -> Extent:
        try:
            return self._extents[index]
        except KeyError:
            raise CheckpointFormatError(
                f"{self._location(RECORD_NAME)}: no extent recorded for {describe(index)}"
            ) from None

    def _read_batch(self, name: str, batch: list[MetadataIndex],
                    by_extent: dict[MetadataIndex, list[ReadItem]], planner: LoadPlanner) -> None:
        targets = [self._destination(i, by_extent[i], planner) for i in batch]
        self._fill(name, [(self._extent(i).offset, buf)
                          for i, (buf, _) in zip(batch, targets, strict=True)],
                   f"{describe(batch[0])} and {len(batch) - 1} more")
        for index, (buf, finish) in zip(batch, targets, strict=True):
            self._deliver(index, buf, finish)

    def _read_file(self, name: str, reads: list[tuple[int, memoryview]],
                   may_shift: MayShift | None) -> None:
        self._store.read(name, reads)  # stores reading in place take ``may_shift`` too

    def _shift_check(self, planner: LoadPlanner) -> MayShift | None:
        """Where in ``planner``'s memory reads may land shifted (none: the default)."""
        return None

    def _dtype_name(self, index: MetadataIndex) -> str | None:
        chunk = self._chunks.get(index)
        return None if chunk is None else dtype_name(chunk[0])

    def _deliver(self, index: MetadataIndex, buf: memoryview, finish: Callable[[], None],
                 checksum: str | None = None) -> None:
        """Check a filled extent's checksum (unless ``verify=False``), then deliver it;
        ``checksum``: the content checksum of ``buf`` when the read computed it already."""
        if self.verify:
            ext = self._extent(index)
            identity = extent_identity(index, self._dtype_name(index), ext)
            if checksum is None:
                verify_checksum(buf, ext, describe(index), self.path, identity)
            else:
                check_digest(checksum, ext, describe(index), self.path, identity)
        finish()

    def _destination(self, index: MetadataIndex, reqs: list[ReadItem],
                     planner: LoadPlanner) -> tuple[memoryview, Callable[[], None]]:
        """A buffer to read the stored extent into and a callback that delivers it."""
        ext = self._extent(index)  # lengths and codec were validated with the record
        if ext.codec == "identity":
            return self._raw_destination(index, ext, reqs, planner)
        try:
            codec = get_codec(ext.codec)
        except KeyError as e:
            raise CheckpointFormatError(f"{self._location(ext.file)}: {describe(index)}: "
                                        f"{e.args[0]}") from None
        raw_view, deliver = self._raw_destination(index, ext, reqs, planner)
        stored = byte_view(aligned_bytes(ext.length))

        def decode_and_deliver() -> None:
            try:
                codec.decode_into(stored, raw_view)
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"{self._location(ext.file)}: {describe(index)}: cannot decode "
                    f"{ext.codec} extent: {e}") from None
            deliver()
        return stored, decode_and_deliver

    def _raw_destination(self, index: MetadataIndex, ext: Extent, reqs: list[ReadItem],
                         planner: LoadPlanner) -> tuple[memoryview, Callable[[], None]]:
        """A buffer for the extent's raw bytes and a callback that delivers them."""
        where = self._location(ext.file)
        if reqs[0].type == LoadItemType.BYTE_IO:
            raw = bytearray(ext.raw_length)  # == length, within the file: bounded

            def deliver_bytes() -> None:
                if ext.value == BYTESIO:
                    for req in reqs:
                        deliver_bytesio(planner, req, bytes(raw))
                    return
                if not self.allow_pickle:
                    check_loads_safely(index.fqn, bytes(raw))
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(raw))
            return memoryview(raw), deliver_bytes

        dtype, sizes = self._chunks[index]
        nbytes = ext.raw_length  # validated: the chunk's bytes
        req = reqs[0]
        if len(reqs) == 1 and not any(req.storage_offsets) and list(req.lengths) == list(sizes):
            target = planner.resolve_tensor(req).detach()
            if (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
                    and target.numel() == math.prod(sizes) and nbytes > 0):
                view = byte_view(target)

                def deliver_direct() -> None:
                    planner.commit_tensor(req, target)
                return view, deliver_direct

        staging = aligned_bytes(nbytes)

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
                        f"{where}: {describe(index)}: stored region "
                        f"{list(src.size())} does not fit destination {list(target.size())}")
                target.copy_(src)
                planner.commit_tensor(r, target)
        view = byte_view(staging)
        return view, deliver_copy
