"""Summaries of a committed checkpoint, and full re-verification of its checksums.

Both work on any location a dcp_plus reader reads (:func:`~dcp_plus.readers.locate.reader_for`:
a local path, ``nfs://``, ``s3://`` or another fsspec URL), through the reader's store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dcp_plus.errors import UnsafeCheckpointError
from dcp_plus.format.record import RECORD_NAME, Extent, decode_record, dtype_name
from dcp_plus.readers.base import PICKLE_PROTOCOL_BYTE, ExtentReader
from dcp_plus.readers.file_check import VerifyReport, check_file
from dcp_plus.readers.locate import reader_for

__all__ = ["VerifyReport", "load_record", "stored_bytes", "summarize", "verify"]

Location = str | os.PathLike


def _open(location: Location, storage_options: Mapping[str, Any] | None) -> ExtentReader:
    return reader_for(location, storage_options)


def _record(reader: ExtentReader) -> Metadata:
    data = reader._record_bytes()
    if data[:1] == bytes([PICKLE_PROTOCOL_BYTE]):
        raise UnsafeCheckpointError(
            f"{reader.path}: {RECORD_NAME} is a pickle (a stock DCP checkpoint), and dcp-plus "
            "never unpickles: unpickling can run arbitrary code. To read it, convert it once "
            "with `dcp-plus convert --allow-pickle SRC DST` (only for checkpoints you trust)")
    return decode_record(data, reader._location(RECORD_NAME))


def load_record(location: Location, storage_options: Mapping[str, Any] | None = None,
                ) -> Metadata:
    """Parse the commit record at ``location``; stock (pickled) records are refused."""
    reader = _open(location, storage_options)
    try:
        return _record(reader)
    finally:
        reader.close()


def stored_bytes(md: Metadata) -> int:
    """The bytes :func:`verify` reads: every extent's stored length."""
    return sum(e.length for e in _extents(md).values())


def _extents(md: Metadata) -> dict[MetadataIndex, Extent]:
    return cast(dict[MetadataIndex, Extent], md.storage_data)


def summarize(location: Location, storage_options: Mapping[str, Any] | None = None,
              ) -> dict[str, Any]:
    """Per-item rows (name, dtype, shape, bytes, codec, file) and totals, JSON-ready."""
    md = load_record(location, storage_options)
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
        "path": os.fspath(location),
        "save_id": md.storage_meta.save_id if md.storage_meta else None,
        "items": rows,
        "totals": {"tensors": n_tensors, "items": len(md.state_dict_metadata),
                   "extents": len(rows), "files": len({r["file"] for r in rows}),
                   "bytes": raw, "stored_bytes": stored,
                   "ratio": raw / stored if stored else 1.0},
    }


def verify(location: Location, progress: Callable[[int], None] | None = None,
           record: Metadata | None = None,
           storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Re-read and re-checksum every extent; at most one problem line per damaged file
    (named relative to the checkpoint), naming its tensors.

    ``record``: the checkpoint's :func:`load_record`, if the caller has it already.
    """
    reader = _open(location, storage_options)
    try:
        md = _record(reader) if record is None else record
        report = VerifyReport(os.fspath(location))
        by_file: dict[str, list[tuple[MetadataIndex, Extent]]] = {}
        for index, ext in _extents(md).items():
            by_file.setdefault(ext.file, []).append((index, ext))
        dtypes = {fqn: dtype_name(item.properties.dtype)
                  for fqn, item in md.state_dict_metadata.items()
                  if isinstance(item, TensorStorageMetadata)}
        for name, entries in sorted(by_file.items()):
            check_file(reader._store, name, entries, dtypes, report, progress)
        return report
    finally:
        reader.close()
