"""One data file re-checked against the record: every extent's checksum, the padding between
extents, bytes past the last extent, truncation; one problem line per damaged file.

The file is read front to back in contiguous batches of at most 16 MiB (one request each, on
any store), whatever the number of extents in it.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.checksum import format_checksum, new_hasher
from dcp_plus.format.codecs import stored_length
from dcp_plus.format.layout import ALIGNMENT
from dcp_plus.format.parts import PART_ALGORITHM
from dcp_plus.format.record import RECORD_NAME, Extent, extent_identity
from dcp_plus.readers.base import describe
from dcp_plus.readers.extents import digest_matches
from dcp_plus.storage.objectio import ObjectStore

BATCH = 16 << 20
SHOWN = 4
"""Items named in one problem line; the rest are counted."""

Entry = tuple[MetadataIndex, Extent]
GAP, TAIL = -1, -2
"""Piece tags: padding between extents, and bytes after the last one."""


@dataclass
class VerifyReport:
    """Outcome of :func:`~dcp_plus.readers.inspect.verify`: extents and bytes checked, and
    one problem line per damaged file (named relative to the checkpoint at ``path``)."""

    path: str
    extents: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _listing(items: Sequence[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _span(index: MetadataIndex, ext: Extent, length: int | None = None) -> str:
    end = ext.offset + (ext.length if length is None else length)
    return f"{describe(index)} (bytes {ext.offset}..{end})"


@dataclass
class _FileState:
    """What one file's check found, turned into its problem line at the end."""

    name: str
    mismatched: list[str] = field(default_factory=list)
    past_end: list[str] = field(default_factory=list)
    padding: list[list[int]] = field(default_factory=list)
    tail: tuple[int, int] | None = None
    """``(start, size)`` of bytes after the last extent that are not alignment padding."""
    record_lengths: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    explained_until: int = 0
    """Bytes before this offset belong to an extent whose recorded length was edited."""

    def line(self, size: int) -> str | None:
        issues = list(self.other)
        if self.past_end:
            issues.append(f"truncated: the file has {size} bytes, but the record places "
                          f"{len(self.past_end)} extent(s) past its end: "
                          f"{_listing(self.past_end)}")
        if self.mismatched:
            issues.append(f"checksum mismatch in {_listing(self.mismatched)}: the stored "
                          "bytes differ from what the record says they hold (the data is "
                          "corrupt)")
        if self.padding:
            ranges = [f"{a}..{b}" for a, b in self.padding]
            issues.append(f"bytes {_listing(ranges)} lie outside every extent and are not "
                          "zero padding: the data file is damaged")
        if self.tail:
            start, end = self.tail
            issues.append(f"{end - start} bytes after the last extent (bytes {start}..{end}): "
                          "appended, or the file was replaced")
        return f"{self.name}: {'; '.join(issues)}" if issues else None


def _pieces(plan: list[tuple[int, int, int]]) -> Iterator[tuple[int, list[tuple[int, int, int]]]]:
    """``plan``'s ``(start, end, tag)`` spans (ascending, non-overlapping) cut into pieces
    of at most :data:`BATCH` bytes and grouped into contiguous batches of at most that size:
    ``(batch start, pieces)``."""
    batch: list[tuple[int, int, int]] = []
    start = end = 0
    for s, e, tag in plan:
        pos = s
        while True:
            if batch and (pos != end or end - start >= BATCH):
                yield start, batch
                batch = []
            if not batch:
                start = end = pos
            cut = min(e, pos + BATCH - (end - start))
            batch.append((pos, cut, tag))
            end = cut
            pos = cut
            if pos >= e:
                break
    if batch:
        yield start, batch


def _hasher(ext: Extent) -> Any:
    """How an entry's bytes are hashed: a part's raw hash (xxh3-128), else the extent's."""
    return xxhash.xxh3_128() if ext.checksum.startswith(PART_ALGORITHM) else new_hasher()


def _read(store: ObjectStore, name: str, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    store.read(name, [(offset, memoryview(buf))])
    return bytes(buf)


def _hash(store: ObjectStore, name: str, offset: int, length: int) -> str:
    hasher = new_hasher()
    for start, batch in _pieces([(offset, offset + length, 0)]):
        hasher.update(_read(store, name, start, batch[-1][1] - start))
    return format_checksum(hasher)


def _edited_length(store: ObjectStore, name: str, index: MetadataIndex, ext: Extent,
                   dtype: str | None, size: int) -> int | None:
    """The true stored length of a compressed extent whose recorded length was edited: its
    header announces another length, and at that length the bytes match the record's
    checksum (which was bound to the original length). None otherwise."""
    if ext.codec == "identity":
        return None

    def read_at(off: int, n: int) -> bytes:
        n = max(0, min(n, size - ext.offset - off))
        return _read(store, name, ext.offset + off, n) if n else b""

    true = stored_length(read_at)
    if true is None or true == ext.length or ext.offset + true > size:
        return None
    fixed = ext._replace(length=true)
    actual = _hash(store, name, ext.offset, true)
    return true if digest_matches(actual, fixed, extent_identity(index, dtype, fixed)) else None


def check_file(store: ObjectStore, name: str, entries: list[Entry],
               dtypes: dict[str, str], report: VerifyReport,
               progress: Callable[[int], None] | None = None) -> None:
    """Check data file ``name`` holding ``entries``; append its problems to ``report``
    (record-length edits as a line on the record, the rest as one line on the file)."""
    state = _FileState(name)
    try:
        size = store.sizes([name])[name]
    except (CheckpointFormatError, OSError) as e:
        report.problems.append(f"{name}: {e} (it holds {_listing([describe(i) for i, _ in entries])})")
        return
    if size is None:
        report.problems.append(f"{name}: missing (it holds "
                               f"{_listing([describe(i) for i, _ in entries])})")
        return
    entries = sorted(entries, key=lambda e: e[1].offset)
    plan: list[tuple[int, int, int]] = []
    pos = 0
    for k, (index, ext) in enumerate(entries):
        report.extents += 1
        if ext.offset > pos:
            plan.append((pos, min(ext.offset, size), GAP))
        end = ext.offset + ext.length
        if ext.length and end > size:
            try:
                true = _edited_length(store, name, index, ext, dtypes.get(index.fqn), size)
            except (OSError, EOFError, CheckpointFormatError):
                true = None
            if true is None:
                state.past_end.append(_span(index, ext))
            else:
                _blame_record(state, index, ext, true, name)
                report.bytes += true
            pos = max(pos, min(end, size) if true is None else ext.offset + true)
            continue
        plan.append((ext.offset, end, k))
        pos = max(pos, end)
    if size > pos:
        plan.append((pos, size, TAIL))
    plan = [p for p in plan if p[1] > p[0] or p[2] >= 0]
    try:
        _scan(store, name, entries, plan, dtypes, size, state, report, progress)
    except (OSError, CheckpointFormatError) as e:  # a bad sector, a store that gave up
        state.other.append(f"could not be read to the end ({e})")
    if state.record_lengths:
        report.problems.append(f"{RECORD_NAME}: {'; '.join(state.record_lengths)}: the record "
                               "was edited, the data is intact")
    line = state.line(size)
    if line:
        report.problems.append(line)


def _blame_record(state: _FileState, index: MetadataIndex, ext: Extent, true: int,
                  name: str) -> None:
    state.record_lengths.append(
        f"it gives {describe(index)} a length of {ext.length} bytes, but the {ext.codec} "
        f"extent stored at {name} offset {ext.offset} is {true} bytes and matches the "
        "record's checksum at that length")
    state.explained_until = max(state.explained_until, ext.offset + true)


def _scan(store: ObjectStore, name: str, entries: list[Entry], plan: list[tuple[int, int, int]],
          dtypes: dict[str, str], size: int, state: _FileState, report: VerifyReport,
          progress: Callable[[int], None] | None) -> None:
    hashers: dict[int, Any] = {}
    # page-aligned (an anonymous mapping): O_DIRECT reads of a local store land in it directly
    buf = mmap.mmap(-1, min(BATCH, sum(e - s for s, e, _ in plan)) or 1)
    for start, batch in _pieces(plan):
        view = memoryview(buf)[: batch[-1][1] - start]
        try:
            if len(view):
                store.read(name, [(start, view)])
        except EOFError:
            state.other.append(f"the file changed while it was verified (it ended before "
                               f"byte {batch[-1][1]})")
            return
        for s, e, tag in batch:
            piece = view[s - start : e - start]
            if tag < 0:
                _check_zeros(piece, s, e, tag, size, state)
                continue
            hasher = hashers.setdefault(tag, _hasher(entries[tag][1]))
            hasher.update(piece)
            index, ext = entries[tag]
            if e == ext.offset + ext.length:
                del hashers[tag]
                digest = (f"{PART_ALGORITHM}:{hasher.hexdigest()}" if ext.checksum.startswith(
                    PART_ALGORITHM) else format_checksum(hasher))
                _finish_extent(store, name, index, ext, digest,
                               dtypes.get(index.fqn), size, state)
                report.bytes += ext.length
                if progress is not None:
                    progress(ext.length)


def _finish_extent(store: ObjectStore, name: str, index: MetadataIndex, ext: Extent,
                   actual: str, dtype: str | None, size: int, state: _FileState) -> None:
    if not ext.checksum:  # an encoded part: checked once decoded (parts_verify)
        return
    if ext.checksum.startswith(PART_ALGORITHM):  # an uncompressed part of a chunked extent
        if actual != ext.checksum:
            state.mismatched.append(_span(index, ext))
        return
    try:
        if digest_matches(actual, ext, extent_identity(index, dtype, ext)):
            return
    except CheckpointFormatError as e:
        state.other.append(f"{describe(index)}: {e}")
        return
    true = _edited_length(store, name, index, ext, dtype, size)
    if true is None:
        state.mismatched.append(_span(index, ext))
    else:
        _blame_record(state, index, ext, true, name)


def _check_zeros(piece: memoryview, s: int, e: int, tag: int, size: int,
                 state: _FileState) -> None:
    skip = max(0, min(e, state.explained_until) - s)
    if not piece[skip:].tobytes().strip(b"\0"):
        if tag == GAP or state.tail:
            return
        start = max(s, state.explained_until)  # the tail's first piece
        # zeros that only pad the file to a whole block are alignment padding
        if start >= size or size % ALIGNMENT == 0 and size - start < ALIGNMENT:
            return
    elif tag == GAP:
        if state.padding and state.padding[-1][1] == s + skip:
            state.padding[-1][1] = e
        else:
            state.padding.append([s + skip, e])
        return
    if state.tail is None:
        state.tail = (max(s, state.explained_until), size)
