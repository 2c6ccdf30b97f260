"""Save files in a checkpoint's folder that no commit record reads.

A save writes data files (and, in a multi-rank save, extent tables) beside the record it
commits. An overwrite save killed before its commit leaves its own; one stopped between its
commit and its clean-up leaves those of the record it replaced. An incremental overwrite
(``Increments(keep_replaced=True)``: the manager's and TorchTitan's) keeps the replaced files
on purpose, because checkpoints beside it may read them: those stay out of the list while a
committed sibling's record reads them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from dcp_plus.errors import CheckpointNotFoundError
from dcp_plus.format.extent_set import extent_files
from dcp_plus.format.layout import is_save_file
from dcp_plus.format.parts import spans
from dcp_plus.format.record import RECORD_NAME, Extent, decode_record, record_bases
from dcp_plus.manager.storage import backend_for
from dcp_plus.readers.base import ExtentReader
from dcp_plus.readers.locate import reader_for
from dcp_plus.storage.location import sibling_path


def strays(location: str | os.PathLike, record: Metadata,
           storage_options: Mapping[str, Any] | None = None
           ) -> tuple[list[tuple[str, int | None]], str | None]:
    """:func:`stray_files` of the checkpoint at ``location`` (its ``record`` decoded), and
    why they could not be told (None when they could)."""
    reader = reader_for(location, storage_options)
    try:
        return stray_files(reader, cast(Mapping[MetadataIndex, Extent], record.storage_data),
                           storage_options), None
    except Exception as e:  # noqa: BLE001 (the checksums' verdict stands; only this is unknown)
        return [], str(e) or type(e).__name__
    finally:
        reader.close()


def stray_files(reader: ExtentReader, extents: Mapping[MetadataIndex, Extent],
                storage_options: Mapping[str, Any] | None = None
                ) -> list[tuple[str, int | None]]:
    """The save files in ``reader``'s checkpoint folder that neither its own record
    (``extents``) nor a committed sibling's reads, sorted, with their sizes (None: gone
    meanwhile). Files kept under key prefixes elsewhere are not looked for.

    Raises:
        DcpPlusError, OSError: the folder or a sibling's record could not be read (then
            no file can be said to be unread).
    """
    store = reader._store
    named = extent_files(extents)
    candidates = sorted(n for n in store.list() if is_save_file(n) and n not in named)
    if candidates:
        read_by_siblings = _read_by_siblings(reader, storage_options)
        candidates = [n for n in candidates if n not in read_by_siblings]
    sizes = store.sizes(candidates) if candidates else {}
    return [(n, sizes.get(n)) for n in candidates]


def _read_by_siblings(reader: ExtentReader, storage_options: Mapping[str, Any] | None
                      ) -> set[str]:
    """The files of ``reader``'s checkpoint that the commit records beside it read."""
    where, sep, query = reader.path.partition("?")
    name = where.rstrip("/").rpartition("/")[2]
    parent = sibling_path(reader.path, "").partition("?")[0].rstrip("/") or "."
    backend, location = backend_for(parent + sep + query, storage_options)
    out: set[str] = set()
    for other in backend.listdir(location):
        if other == name or other.startswith("."):
            continue
        sibling = reader.sibling(other)
        try:
            data = sibling._record_bytes()
        except CheckpointNotFoundError:
            continue  # not a checkpoint, or an uncommitted one: it reads nothing
        finally:
            sibling.close()
        source = sibling._location(RECORD_NAME)
        if name not in record_bases(data, source):
            continue  # it references no file here (the common case): not decoded
        record = decode_record(data, source)
        out |= files_read_in(record.storage_data.values(), name)
    return out


def files_read_in(extents: Iterable[Extent], name: str) -> set[str]:
    """The files of the sibling checkpoint ``name`` that ``extents`` (another checkpoint's)
    read: whole extents it is the ``base`` of, and parts (delta bases included) lying there."""
    return {file for e in extents for where, file, _ in spans(e) if where == name}
