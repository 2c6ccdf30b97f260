"""Write results as extents: each rank's extents, and the O(1)-per-rank exchange of them
through extent tables stored beside the data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.checksum import bind_checksum, checksum_bytes
from dcp_plus.format.extent import identity_of
from dcp_plus.format.extent_columns import encode_extent_table
from dcp_plus.format.extent_set import ExtentSet
from dcp_plus.format.layout import extent_table_name
from dcp_plus.format.record import Extent, dtype_name
from dcp_plus.format.strict_json import check_text
from dcp_plus.writers.layout import FilePlan

TABLE_FQN = "__dcp_plus_extent_table__"


@dataclasses.dataclass(frozen=True)
class ExtentTableRef:
    """The one write result a rank sends in a multi-rank save: where its extents are."""

    name: str
    checksum: str
    count: int
    prefix: str | None = None
    """The key prefix the table (and its rank's data) lies under."""


def build_extents(files: Sequence[FilePlan], raw_lengths: dict[int, int],
                  codecs: dict[int, str], sums: dict[int, str], prefix: str | None = None
                  ) -> list[tuple[MetadataIndex, Extent]]:
    """The extents of the items placed in ``files`` (under key ``prefix``); raw lengths,
    codecs and content ``sums`` by ``id(item)``; checksums bound to each extent's identity
    (version 2)."""
    placed = [(fp.name, r, off) for fp in files for r, off in fp.placed]
    _check_keys([r.item.index.fqn for _, r, _ in placed])
    names: dict[torch.dtype, str] = {}
    out = []
    for name, r, off in placed:
        index = r.item.index
        td = r.item.tensor_data
        dname = None
        if td is not None:
            dtype = td.properties.dtype
            dname = names.get(dtype) or names.setdefault(dtype, dtype_name(dtype))
        key = id(r)
        raw_length, length, codec = raw_lengths[key], len(r.data), codecs[key]
        identity = identity_of(index.fqn, index.offset, dname, raw_length, length, codec,
                               r.value)
        out.append((index, Extent(name, off, length, raw_length, codec,
                                  bind_checksum(sums[key], identity), r.value, prefix)))
    return out


def _check_keys(fqns: list[str]) -> None:
    """Every key storable as UTF-8 text (checked at once, then named one by one)."""
    if check_text("\x01".join(fqns)) is None:
        return
    for fqn in fqns:
        problem = check_text(fqn)
        if problem is not None:
            raise CheckpointFormatError(f"state dict key {fqn!r} {problem}; "
                                        "dcp_plus records keys as UTF-8 text")


def write_results(rank: int, world: int, save_id: str,
                  extents: list[tuple[MetadataIndex, Extent]],
                  put_table: Callable[[str, bytes], None],
                  prefix: str | None = None) -> list[WriteResult]:
    """One result per extent in a one-rank save; else the extents go to a table stored with
    ``put_table`` and the one result names it."""
    if world <= 1:
        return [WriteResult(index=i, size_in_bytes=e.length, storage_data=e) for i, e in extents]
    data = encode_extent_table(dict(extents))
    name = extent_table_name(rank, save_id)
    put_table(name, data)
    ref = ExtentTableRef(name, checksum_bytes(data), len(extents), prefix)
    return [WriteResult(index=MetadataIndex(f"{TABLE_FQN}/{rank}"),
                        size_in_bytes=sum(e.length for _, e in extents), storage_data=ref)]


def collect_extents(results: list[list[WriteResult]], get_table: Callable[[str], bytes],
                    location: Callable[[str], str]
                    ) -> tuple[Mapping[MetadataIndex, Extent], list[str]]:
    """Every rank's extents (tables read back with ``get_table`` and checked; kept as columns,
    an :class:`~dcp_plus.format.extent_set.ExtentSet`) and the names of the tables read."""
    columns = ExtentSet()
    rows: dict[MetadataIndex, Extent] = {}
    tables = []
    for rank_results in results:
        for wr in rank_results:
            ref = wr.storage_data
            if isinstance(ref, ExtentTableRef):
                data = get_table(ref.name)
                where = location(ref.name)
                if checksum_bytes(data) != ref.checksum:
                    raise CheckpointFormatError(f"{where}: extent table does not match the "
                                                "checksum its rank reported")
                count = columns.add_table(data, where)
                if count != ref.count:
                    raise CheckpointFormatError(f"{where}: {count} extents, its rank "
                                                f"reported {ref.count}")
                tables.append(ref.name)
            else:
                rows[wr.index] = ref
    if not tables:
        return rows, tables
    columns.check_unique(f"{location(tables[0])} and the other ranks' extent tables")
    if rows:  # not written by dcp_plus ranks alike; never in one save
        return {**columns, **rows}, tables
    return columns, tables


def table_prefixes(results: list[list[WriteResult]]) -> dict[str, str]:
    """The key prefix of each extent table the results name that has one."""
    return {wr.storage_data.name: wr.storage_data.prefix
            for rank_results in results for wr in rank_results
            if isinstance(wr.storage_data, ExtentTableRef) and wr.storage_data.prefix}
