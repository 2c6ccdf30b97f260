"""Reading the extents of incremental checkpoints: parts (here or in sibling checkpoints,
XOR deltas decoded against the part they were taken against) and whole references.

Each part is read into its place in the extent's destination and its xxh3-128 checked there
(while it is in cache); a delta part first rebuilds the part it was taken against. Stores of
sibling checkpoints are opened from the reader itself (same kind, same settings) as their
names come up, once each.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from dcp_plus.format.extent import Extent, extent_identity
from dcp_plus.format.parts import Part, parts_digest, spans
from dcp_plus.readers.extents import check_digest, check_extent_bounds, describe
from dcp_plus.readers.part_fill import PartBatch
from dcp_plus.storage.direct_landing import MayShift


class ExtentReader(Protocol):
    """What this module uses of :class:`~dcp_plus.readers.base.ExtentReader` (which imports
    it: a protocol keeps the import one-way)."""

    path: str
    verify: bool
    threads: int

    @property
    def _store(self) -> Any: ...
    def sibling(self, name: str) -> Any: ...
    def _close_store(self) -> None: ...
    def _location(self, name: str) -> str: ...
    def _extent(self, index: MetadataIndex) -> Extent: ...
    def _fill(self, name: str, reads: list[tuple[int, memoryview]], what: str,
              may_shift: MayShift | None = None) -> None: ...
    def _read_extents(self, by_extent: dict[MetadataIndex, list[ReadItem]],
                      planner: LoadPlanner, may_shift: MayShift | None = None) -> None: ...
    def _raw_destination(self, index: MetadataIndex, ext: Extent, reqs: list[ReadItem],
                         planner: LoadPlanner) -> tuple[memoryview, Callable[[], None]]: ...


class Siblings:
    """The readers of the sibling checkpoints an incremental one references."""

    def __init__(self, reader: ExtentReader) -> None:
        self.reader = reader
        self._open: dict[str, ExtentReader] = {}
        self._lock = threading.Lock()

    def get(self, name: str | None) -> ExtentReader:
        """The reader of checkpoint ``name`` (None: the reader's own)."""
        if name is None:
            return self.reader
        with self._lock:
            other = self._open.get(name)
            if other is None:
                other = self._open[name] = self.reader.sibling(name)
            return other

    def close(self) -> None:
        for other in self._open.values():
            other._close_store()
        self._open.clear()


def needs_parts(ext: Extent) -> bool:
    """Whether ``ext`` is read here rather than as a plain extent of this checkpoint."""
    return ext.parts is not None or ext.base is not None


def check_references(reader: ExtentReader, siblings: Siblings,
                     extents: Iterable[tuple[str, Extent]]) -> None:
    """Every byte a reference names exists: each part's file in its checkpoint is there and
    long enough (a deleted or truncated base is named before anything is read).

    Raises:
        CheckpointFormatError: naming the base checkpoint's file and the tensor.
    """
    wanted: dict[str | None, list[tuple[str, Extent]]] = defaultdict(list)
    for what, ext in extents:
        for where, file, end in spans(ext):
            wanted[where].append((what, Extent(file, 0, end, end, "identity", "")))
    for name, refs in wanted.items():
        other = siblings.get(name)
        sizes = other._store.sizes(sorted({e.file for _, e in refs}))
        where = (f"base checkpoint {name!r} ({other.path})" if name is not None
                 else reader.path)
        check_extent_bounds(refs, sizes.__getitem__, partial(_located, other, where))


BATCH_BYTES = 64 << 20
"""Destination and scratch bytes of the parts read and decoded together."""


def read_parts(reader: ExtentReader, siblings: Siblings,
               by_extent: dict[MetadataIndex, list[ReadItem]], planner: LoadPlanner,
               dtype_of: Callable[[MetadataIndex], str | None],
               may_shift: MayShift | None = None) -> None:
    """Read, verify (``reader.verify``) and deliver the extents of ``by_extent``, each of
    which :func:`needs_parts`: parts in batches of :data:`BATCH_BYTES`, each extent
    delivered once its last batch is done; ``may_shift``: which destinations reads may
    pass through shifted (the reader's ``_shift_check``; the same for every sibling)."""
    with ThreadPoolExecutor(reader.threads, thread_name_prefix="dcpp-parts") as pool:
        batch = PartBatch(reader.verify, may_shift)
        waiting: list[Callable[[], None]] = []
        previous: tuple[PartBatch, list[Callable[[], None]]] | None = None

        def turn() -> None:  # start this batch's reads, then decode the previous batch
            nonlocal batch, waiting, previous
            batch.start(siblings.get, pool)
            if previous is not None:
                _finish(*previous, siblings, pool)
            previous = batch, waiting
            batch, waiting = PartBatch(reader.verify, may_shift), []

        for index, reqs in by_extent.items():
            ext = reader._extent(index)
            assert ext.parts is not None  # a reference always has them (record checks)
            what = describe(index)
            if reader.verify:
                check_digest(parts_digest(ext.parts), ext, what, reader.path,
                             extent_identity(index, dtype_of(index), ext))
            raw, deliver = reader._raw_destination(index, ext, reqs, planner)
            start = 0
            for p in ext.parts:
                if batch.nbytes >= BATCH_BYTES:
                    turn()
                batch.add(p, ext.base, raw[start : start + p.raw], what)
                start += p.raw
            # delivered after the batch of its last part (earlier batches are done by then)
            waiting.append(deliver)
        turn()
        assert previous is not None
        _finish(*previous, siblings, pool)


def _finish(batch: PartBatch, deliveries: list[Callable[[], None]], siblings: Siblings,
            pool: ThreadPoolExecutor) -> None:
    batch.finish(siblings.get, pool)
    for deliver in deliveries:
        deliver()


def _located(other: ExtentReader, where: str, name: str) -> str:
    return f"{other._location(name)} (in {where})"


def fill_part(reader: ExtentReader, siblings: Siblings, p: Part, holder: str | None,
              out: memoryview, what: str) -> None:
    """Part ``p`` (in checkpoint ``p.where``, else ``holder``) decoded into ``out``."""
    batch = PartBatch(reader.verify)
    batch.add(p, holder, out, what)
    with ThreadPoolExecutor(1) as pool:
        batch.run(siblings.get, pool)
