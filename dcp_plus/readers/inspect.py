"""Summaries of a committed checkpoint, and full re-verification of its checksums."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dcp_plus.errors import CheckpointFormatError, CorruptCheckpointError, UnsafeCheckpointError
from dcp_plus.format.checksum import format_checksum, new_hasher
from dcp_plus.format.record import RECORD_NAME, Extent, decode_record, dtype_name, extent_identity
from dcp_plus.readers.extents import check_digest
from dcp_plus.readers.local import describe, read_record
from dcp_plus.storage.fileio import open_regular, preadinto_all


def load_record(path: str) -> Metadata:
    """Parse the commit record at ``path``; stock (pickled) records are refused."""
    data = read_record(path)
    if data[:1] == b"\x80":  # a pickle's protocol byte
        raise UnsafeCheckpointError(
            f"{path}: {RECORD_NAME} is not a dcp_plus record (a stock DCP pickle?); "
            "dcp-plus never unpickles records"
        )
    return decode_record(data, os.path.join(path, RECORD_NAME))


def stored_bytes(md: Metadata) -> int:
    """The bytes :func:`verify` reads: every extent's stored length."""
    return sum(e.length for e in _extents(md).values())


def _extents(md: Metadata) -> dict[MetadataIndex, Extent]:
    return cast(dict[MetadataIndex, Extent], md.storage_data)


def summarize(path: str) -> dict[str, Any]:
    """Per-item rows (name, dtype, shape, bytes, codec, file) and totals, JSON-ready."""
    md = load_record(path)
    rows = []
    for index, ext in sorted(_extents(md).items(), key=lambda kv: (kv[0].fqn, kv[1].offset)):
        item = md.state_dict_metadata[index.fqn]
        row: dict[str, Any] = {"name": index.fqn, "chunk": None if index.offset is None
                               else list(index.offset), "bytes": ext.raw_length,
                               "stored_bytes": ext.length, "codec": ext.codec, "file": ext.file}
        if isinstance(item, TensorStorageMetadata):
            row.update(kind="tensor", dtype=dtype_name(item.properties.dtype),
                       shape=list(item.size))
        else:
            row.update(kind="bytes", dtype=None, shape=None)
        rows.append(row)
    raw = sum(r["bytes"] for r in rows)
    stored = sum(r["stored_bytes"] for r in rows)
    n_tensors = sum(isinstance(v, TensorStorageMetadata) for v in md.state_dict_metadata.values())
    return {
        "path": path,
        "save_id": md.storage_meta.save_id if md.storage_meta else None,
        "items": rows,
        "totals": {"tensors": n_tensors, "items": len(md.state_dict_metadata),
                   "extents": len(rows), "files": len({r["file"] for r in rows}),
                   "bytes": raw, "stored_bytes": stored,
                   "ratio": raw / stored if stored else 1.0},
    }


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`: bytes checked and one message per problem."""

    path: str
    extents: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str, progress: Callable[[int], None] | None = None,
           record: Metadata | None = None) -> VerifyReport:
    """Re-read and re-checksum every extent; problems name the file and the tensor.

    ``record``: the checkpoint's :func:`load_record`, if the caller has it already.
    """
    md = load_record(path) if record is None else record
    report = VerifyReport(path)
    by_file: dict[str, list[tuple[MetadataIndex, Extent]]] = {}
    for index, ext in _extents(md).items():
        by_file.setdefault(ext.file, []).append((index, ext))
    dtypes = {fqn: dtype_name(item.properties.dtype)
              for fqn, item in md.state_dict_metadata.items()
              if isinstance(item, TensorStorageMetadata)}
    for name, entries in sorted(by_file.items()):
        full = os.path.join(path, name)
        try:
            fd = open_regular(path, name)
        except (CheckpointFormatError, OSError) as e:
            report.problems.append(f"{os.path.join(path, name)}: {e} (holds "
                                   f"{', '.join(describe(i) for i, _ in entries[:3])}...)")
            continue
        try:
            size = os.fstat(fd).st_size
            covered = 0
            for index, ext in sorted(entries, key=lambda e: e[1].offset):
                _check_padding(fd, full, covered, min(ext.offset, size), report)
                covered = max(covered, ext.offset + ext.length)
                report.extents += 1
                if ext.length and ext.offset + ext.length > size:
                    report.problems.append(
                        f"{full}: {describe(index)} (bytes {ext.offset}..{ext.offset + ext.length})"
                        f" runs past the end of the file ({size} bytes): truncated")
                    continue
                hasher = new_hasher()
                for piece in _pieces(fd, full, ext.offset, ext.offset + ext.length):
                    hasher.update(piece)
                try:
                    check_digest(format_checksum(hasher), ext, describe(index), path,
                                 extent_identity(index, dtypes.get(index.fqn), ext))
                except (CorruptCheckpointError, CheckpointFormatError) as e:
                    report.problems.append(str(e))
                report.bytes += ext.length
                if progress is not None:
                    progress(ext.length)
            _check_padding(fd, full, covered, size, report)
        finally:
            os.close(fd)
    return report


_PIECE = 16 << 20


def _pieces(fd: int, path: str, start: int, end: int) -> Iterator[memoryview]:
    """Bytes ``[start, end)`` of ``fd`` in pieces of at most 16 MiB (one buffer, reused)."""
    buf = memoryview(bytearray(min(_PIECE, max(0, end - start))))
    pos = start
    while pos < end:
        view = buf[: min(_PIECE, end - pos)]
        preadinto_all(fd, view, pos, path)
        yield view
        pos += len(view)


def _check_padding(fd: int, path: str, start: int, end: int, report: VerifyReport) -> None:
    """Bytes between extents are alignment padding, written as zeros: anything else is damage."""
    if end <= start:
        return
    if any(piece.tobytes().strip(b"\0") for piece in _pieces(fd, path, start, end)):
        report.problems.append(f"{path}: padding bytes {start}..{end} (outside every extent) "
                               "are not zero: the data file is damaged")
