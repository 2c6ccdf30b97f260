"""Every rank's extents as one set of columns: what the coordinator of a multi-rank save
holds between reading the ranks' extent tables and writing the columnar commit record.

A ``Mapping[MetadataIndex, Extent]`` like the others, but its rows (one ``MetadataIndex`` and
one ``Extent`` each) are built only when a reader asks for them; the columnar record is
encoded from the columns directly, so a save of ``ranks x tensors`` items builds no object
per item on the coordinator (the row form built about nine).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.extent import Extent
from dcp_plus.format.extent_columns import (
    LOCATION_COLUMNS,
    chunk_key,
    chunk_offsets,
    decode_table_columns,
    drop_empty,
    extents_of,
)
from dcp_plus.format.parts import part_json, references


class ExtentSet(Mapping[MetadataIndex, Extent]):
    """Extents of several extent tables, appended as columns (see the module docstring)."""

    def __init__(self) -> None:
        self.fqn: list[str] = []
        self.chunk: list[list[int] | int | None] = []
        """Offsets per extent: a list, the count of its zero offsets, or None (a value)."""
        self.files: list[str] = []
        self.prefixes: list[str | None] = []
        self.codecs: list[str] = []
        self.columns: dict[str, list[Any]] = {k: [] for k in LOCATION_COLUMNS}
        self._file_pos: dict[str, int] = {}
        self._own: set[str] = set()
        self._codec_pos: dict[str, int] = {}
        self._rows: dict[MetadataIndex, Extent] | None = None

    def add_table(self, data: bytes, source: str) -> int:
        """Append the extents of one rank's table (``source`` names it in errors); returns
        how many it held.

        Raises:
            CheckpointFormatError: the table is damaged, or names a data file another table
                named.
        """
        fqns, chunks, (files, prefixes, codecs, cols) = decode_table_columns(data, source)
        # a data file is written by one rank; a file of a base checkpoint may be referenced
        # by several (an incremental save whose ranks hold other shards than its base's)
        own = {files[f] for f, b in zip(cols["file"], cols["base"], strict=True) if b is None}
        if own & self._own:
            name = sorted(own & self._own)[0]
            raise CheckpointFormatError(f"{source}: data file {name!r} is in another "
                                        "rank's extent table too")
        self._own |= own
        file_at = []
        for name, prefix in zip(files, prefixes, strict=True):
            at = self._file_pos.setdefault(name, len(self._file_pos))
            if at == len(self.files):
                self.files.append(name)
                self.prefixes.append(prefix)
            elif self.prefixes[at] != prefix:
                raise CheckpointFormatError(f"{source}: {name!r} is recorded under two key "
                                            "prefixes")
            file_at.append(at)
        codec_at = [self._codec_pos.setdefault(c, len(self._codec_pos)) for c in codecs]
        self.codecs = list(self._codec_pos)
        self.fqn += fqns
        self.chunk += chunks
        out = self.columns
        out["file"] += map(file_at.__getitem__, cols["file"])
        out["codec"] += map(codec_at.__getitem__, cols["codec"])
        for k in ("offset", "length", "raw_length", "checksum", "value", "base", "parts"):
            out[k] += cols[k]
        self._rows = None
        return len(fqns)

    def check_unique(self, source: str) -> None:
        """Raise ``CheckpointFormatError`` (naming ``source``) if an item has two extents."""
        keys = set(zip(self.fqn, map(chunk_key, self.chunk), strict=True))
        if len(keys) != len(self.fqn):
            seen: set[tuple[str, Any]] = set()
            for fqn, chunk in zip(self.fqn, self.chunk, strict=True):
                if (fqn, chunk_key(chunk)) in seen:
                    raise CheckpointFormatError(f"{source}: {fqn!r} (chunk "
                                                f"{chunk_offsets(chunk)}) has two extents")
                seen.add((fqn, chunk_key(chunk)))

    def locations(self) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """``(tables, columns)`` as :func:`~dcp_plus.format.extent_columns.encode_locations`
        gives them for these extents (files and codecs in order of first use)."""
        tables: dict[str, Any] = {"files": list(self.files)}
        if any(self.prefixes):
            tables["prefixes"] = list(self.prefixes)
        tables["codecs"] = list(self.codecs)
        cols = dict(self.columns)
        if cols["parts"]:  # decoded parts back to their JSON
            cols["parts"] = [None if ps is None else [part_json(p) for p in ps]
                             for ps in cols["parts"]]
        drop_empty(cols)
        return tables, cols

    def file_names(self) -> set[str]:
        return set(self.files)

    def _table(self) -> dict[MetadataIndex, Extent]:
        if self._rows is None:
            locations = (self.files, self.prefixes, self.codecs, self.columns)
            self._rows = dict(zip(map(MetadataIndex, self.fqn, map(chunk_offsets, self.chunk)),
                                  extents_of(locations), strict=True))
        return self._rows

    def __getitem__(self, index: MetadataIndex) -> Extent:
        return self._table()[index]

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self.fqn)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None}


def extent_files(extents: Mapping[MetadataIndex, Extent]) -> set[str]:
    """The data files ``extents`` name."""
    if isinstance(extents, ExtentSet):
        return extents.file_names()
    return {e.file for e in extents.values()}


def bases_of(extents: Mapping[MetadataIndex, Extent]) -> list[str] | None:
    """The sibling checkpoints ``extents`` reference, sorted; None when no extent is chunked
    or a reference (the record is then no incremental one)."""
    if isinstance(extents, ExtentSet):
        bases, parts = extents.columns["base"], extents.columns["parts"]
    else:
        bases = [e.base for e in extents.values()]
        parts = [e.parts for e in extents.values()]
    if not any(b is not None for b in bases) and not any(p is not None for p in parts):
        return None
    names = {b for b in bases if b is not None}
    for ps in parts:
        if ps is not None:
            names |= references(ps)
    return sorted(names)
