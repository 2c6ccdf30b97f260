"""Summaries of a committed checkpoint, and full re-verification of its checksums.

Both work on any location a dcp_plus reader reads (:func:`~dcp_plus.readers.locate.reader_for`:
a local path, ``nfs://``, ``s3://`` or another fsspec URL), through the reader's store.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dcp_plus.errors import UnsafeCheckpointError
from dcp_plus.format.record import RECORD_NAME, Extent, decode_record, dtype_name
from dcp_plus.readers.base import PICKLE_PROTOCOL_BYTE, ExtentReader
from dcp_plus.readers.file_check import VerifyReport, check_file
from dcp_plus.readers.locate import reader_for
from dcp_plus.readers.parts_read import needs_parts
from dcp_plus.readers.parts_verify import own_entries, verify_decoded
from dcp_plus.readers.placement import place_objects

__all__ = ["VerifyReport", "load_record", "stored_bytes", "summarize", "verify"]

Location = str | os.PathLike


def _open(location: Location, storage_options: Mapping[str, Any] | None) -> ExtentReader:
    return reader_for(location, storage_options)


def _record(reader: ExtentReader) -> Metadata:
    data = reader._record_bytes()
    if data[:1] == bytes([PICKLE_PROTOCOL_BYTE]):
        raise UnsafeCheckpointError(
            f"{reader.path}: {RECORD_NAME} is a pickle (a stock DCP checkpoint), and dcp-plus "
            "never unpickles unasked: unpickling can run arbitrary code. Only for a checkpoint "
            "you trust: list it with `dcp-plus inspect --allow-pickle PATH`, or convert it "
            "once with `dcp-plus convert --allow-pickle SRC DST`")
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
    """The bytes :func:`verify` reads: every extent's stored length (an incremental
    checkpoint's: every part's, referenced ones included)."""
    return sum(e.length if e.parts is None else sum(p.length for p in e.parts)
               for e in _extents(md).values())


def _extents(md: Metadata) -> dict[MetadataIndex, Extent]:
    return cast(dict[MetadataIndex, Extent], md.storage_data)


def _stock_record(location: Location, storage_options: Mapping[str, Any] | None,
                  ) -> Metadata | None:
    """A stock DCP checkpoint's metadata, unpickled (the caller trusts it); ``None`` if the
    record at ``location`` is a dcp_plus one."""
    reader = reader_for(location, storage_options, allow_pickle=True)
    try:
        if reader._record_bytes()[:1] != bytes([PICKLE_PROTOCOL_BYTE]):
            return None
        return reader.read_metadata()
    finally:
        reader.close()


def _chunk_bytes(md: Metadata, index: MetadataIndex, stored: int) -> int:
    """Raw bytes of the tensor chunk at ``index`` (``stored`` for a non-tensor item)."""
    item = md.state_dict_metadata[index.fqn]
    if not isinstance(item, TensorStorageMetadata):
        return stored
    offset = list(index.offset or [0] * len(item.size))
    for chunk in item.chunks:
        if list(chunk.offsets) == offset:
            return math.prod(chunk.sizes) * item.properties.dtype.itemsize
    return stored


def _stock_rows(md: Metadata) -> list[tuple[MetadataIndex, dict[str, Any]]]:
    """Rows of a stock record: its ``_StorageInfo`` entries (relative path, offset, stored
    length; stock DCP may store a tensor serialized, larger than its bytes)."""
    out = []
    for index, info in cast(dict[MetadataIndex, Any], md.storage_data).items():
        transforms = getattr(info, "transform_descriptors", None)
        out.append((index, {"bytes": _chunk_bytes(md, index, info.length),
                            "stored_bytes": info.length,
                            "codec": "+".join(transforms) if transforms else "stock",
                            "file": info.relative_path}))
    return out


def summarize(location: Location, storage_options: Mapping[str, Any] | None = None,
              *, allow_pickle: bool = False) -> dict[str, Any]:
    """Per-item rows (name, dtype, shape, bytes, codec, file) and totals, JSON-ready.

    ``allow_pickle``: also list a stock DCP checkpoint, unpickling its record (only for one
    you trust); its rows have codec ``"stock"`` (or its transforms) and the stored length as
    ``stored_bytes``.
    """
    md = _stock_record(location, storage_options) if allow_pickle else None
    if md is not None:
        entries = _stock_rows(md)
    else:
        md = load_record(location, storage_options)
        entries = [(index, {"bytes": ext.raw_length, "stored_bytes": ext.length,
                            "codec": ext.codec, "file": ext.file})
                   for index, ext in _extents(md).items()]
    rows = []
    for index, fields in sorted(entries, key=lambda kv: (kv[0].fqn, kv[0].offset or ())):
        item = md.state_dict_metadata[index.fqn]
        row: dict[str, Any] = {"name": index.fqn, "chunk": None if index.offset is None
                               else list(index.offset), **fields}
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
        place_objects(reader._store, _extents(md), reader._location(RECORD_NAME))
        report = VerifyReport(os.fspath(location))
        by_file: dict[str, list[tuple[MetadataIndex, Extent]]] = {}
        referencing = []
        for index, ext in _extents(md).items():
            if needs_parts(ext):
                referencing.append((index, ext))
                if ext.base is None:  # its own parts, in its own file
                    by_file.setdefault(ext.file, []).extend(own_entries(index, ext))
                continue
            by_file.setdefault(ext.file, []).append((index, ext))
        dtypes = {fqn: dtype_name(item.properties.dtype)
                  for fqn, item in md.state_dict_metadata.items()
                  if isinstance(item, TensorStorageMetadata)}
        for name, entries in sorted(by_file.items()):
            check_file(reader._store, name, entries, dtypes, report, progress)
        verify_decoded(reader, referencing, report, progress)
        return report
    finally:
        reader.close()
