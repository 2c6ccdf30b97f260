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

from dcp_plus.errors import CorruptCheckpointError
from dcp_plus.format.codecs import get_codec
from dcp_plus.format.delta import decode_delta_into
from dcp_plus.format.extent import Extent, extent_identity
from dcp_plus.format.parts import DELTA_CODEC, Part, part_hash, parts_digest
from dcp_plus.readers.extents import check_digest, check_extent_bounds
from dcp_plus.storage.fanout import fan_out


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
    def _fill(self, name: str, reads: list[tuple[int, memoryview]], what: str) -> None: ...
    def _read_extents(self, by_extent: dict[MetadataIndex, list[ReadItem]],
                      planner: LoadPlanner) -> None: ...
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
        if ext.parts is None:
            wanted[ext.base].append((what, ext))
            continue
        for p in ext.parts:
            while p is not None:
                wanted[p.where or ext.base].append(
                    (what, Extent(p.file, p.offset, p.length, p.raw, p.codec, "")))
                p = p.against  # type: ignore[assignment]
    for name, refs in wanted.items():
        other = siblings.get(name)
        sizes = other._store.sizes(sorted({e.file for _, e in refs}))
        where = (f"base checkpoint {name!r} ({other.path})" if name is not None
                 else reader.path)
        check_extent_bounds(refs, sizes.__getitem__, partial(_located, other, where))


def read_parts(reader: ExtentReader, siblings: Siblings,
               by_extent: dict[MetadataIndex, list[ReadItem]], planner: LoadPlanner,
               describe: Callable[[MetadataIndex], str], dtype_of: Callable[[MetadataIndex],
                                                                            str | None]) -> None:
    """Read, verify (``reader.verify``) and deliver the extents of ``by_extent``, each of
    which :func:`needs_parts`."""
    whole: dict[str | None, dict[MetadataIndex, list[ReadItem]]] = defaultdict(dict)
    tasks: list[Callable[[], None]] = []
    finishes: list[Callable[[], None]] = []
    for index, reqs in by_extent.items():
        ext = reader._extent(index)
        if ext.parts is None:  # a whole extent of a base, read as that base's own
            whole[ext.base][index] = reqs
            continue
        what = describe(index)
        if reader.verify:
            check_digest(parts_digest(ext.parts), ext, what, reader.path,
                         extent_identity(index, dtype_of(index), ext))
        raw, deliver = reader._raw_destination(index, ext, reqs, planner)
        start = 0
        for p in ext.parts:
            region = raw[start : start + p.raw]
            start += p.raw
            tasks.append(partial(fill_part, reader, siblings, p, ext.base, region, what))
        finishes.append(deliver)
    for name, group in whole.items():
        siblings.get(name)._read_extents(group, planner)
    with ThreadPoolExecutor(reader.threads, thread_name_prefix="dcpp-parts") as pool:
        fan_out(lambda task: task(), tasks, pool)
    for deliver in finishes:
        deliver()


def _located(other: ExtentReader, where: str, name: str) -> str:
    return f"{other._location(name)} (in {where})"


def fill_part(reader: ExtentReader, siblings: Siblings, p: Part, holder: str | None,
          out: memoryview, what: str) -> None:
    """Part ``p`` (in checkpoint ``p.where``, else ``holder``) decoded into ``out``."""
    source = siblings.get(p.where or holder)
    where = f"{source._location(p.file)}: {what}"
    if p.codec == "identity":
        source._fill(p.file, [(p.offset, out)], what)
    else:
        stored = bytearray(p.length)
        source._fill(p.file, [(p.offset, memoryview(stored))], what)
        try:
            if p.codec == DELTA_CODEC:
                assert p.against is not None  # validated with the record
                old = bytearray(p.raw)
                fill_part(reader, siblings, p.against, holder, memoryview(old), what)
                decode_delta_into(memoryview(stored), old, out)
            else:
                get_codec(p.codec).decode_into(memoryview(stored), out)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: cannot decode {p.codec} part at "
                                         f"{p.offset}: {e}") from None
    if reader.verify and part_hash(out) != p.hash:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch in the part at {p.offset} ({p.raw} bytes): the stored "
            "bytes do not match what the record says; the data file is corrupt")
