"""Which data files a commit concerns: those of the record it replaces (removed once it
commits) and its own (removed when it is refused)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import DcpPlusError
from dcp_plus.format.extent import Extent
from dcp_plus.format.layout import is_data_file
from dcp_plus.format.record import decode_record

log = logging.getLogger(__name__)

Place = Callable[[dict[str, str]], None]
"""Puts files under their key prefixes in the writer's store (raises ValueError on a prefix
the store cannot take, ``CheckpointFormatError`` where the store keeps no prefixes)."""


def files_written(extents: Mapping[MetadataIndex, Extent]) -> dict[str, str | None]:
    """The data files the save that made ``extents`` wrote (by name, their key prefix):
    every data file an extent names that is not a sibling checkpoint's (``base``)."""
    return {e.file: e.prefix for e in extents.values()
            if e.base is None and is_data_file(e.file)}


def committed_by_another(get_record: Callable[[], bytes | None], record: bytes,
                         checkpoint_id: str) -> bool:
    """After a refused commit of ``record``: whether the record there (``get_record``) is
    surely another save's. A store that could not tell whether a retried commit took effect
    may refuse its own; unreadable counts as unknown (the files stay)."""
    try:
        there = get_record()
    except Exception as e:  # noqa: BLE001
        log.warning("%s: could not read back the commit record after a refused commit; this "
                    "save's files stay: %s", checkpoint_id, e)
        return False
    return there is not None and there != record


def replaced_files(record: bytes | None, checkpoint_id: str, placed_store: bool,
                   place: Place) -> set[str]:
    """The data files of the commit record ``record`` (None: there is none), which a commit
    replaces. Files a hostile or unreadable record names are kept (and logged): only our own
    data file names, under prefixes this store can place, are returned."""
    if record is None:
        return set()
    try:
        old = decode_record(record, f"{checkpoint_id}/.metadata")
    except DcpPlusError as e:  # a stock DCP pickle, or damaged: keep its files
        log.warning("%s: the commit record being replaced is not readable (%s); its data "
                    "files are left in place", checkpoint_id, e)
        return set()
    files = files_written(old.storage_data)
    placed = {f: p for f, p in files.items() if p is not None}
    if placed and not placed_store:  # not ours: a hostile record
        log.warning("%s: the replaced commit record names key prefixes; the files under "
                    "them are left in place", checkpoint_id)
        return {f for f, p in files.items() if p is None}
    try:
        if placed:
            place(placed)
    except ValueError as e:  # a hostile record (a prefix this location cannot take)
        log.warning("%s: the replaced commit record's key prefixes are refused (%s); the "
                    "files under them are left in place", checkpoint_id, e)
        return {f for f, p in files.items() if p is None}
    return set(files)
