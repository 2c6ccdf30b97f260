"""What every dcp_plus writer shares: per-save ids, per-rank plan info, the O(1)
write-result exchange through per-rank extent tables, and the commit."""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from dcp_plus.errors import CheckpointFormatError, DcpPlusError
from dcp_plus.format.checksum import bind_checksum, checksum_bytes
from dcp_plus.format.extent import identity_of
from dcp_plus.format.layout import is_data_file
from dcp_plus.format.record import (
    Extent,
    decode_extent_table,
    decode_record,
    dtype_name,
    encode_extent_table,
    encode_record,
)
from dcp_plus.format.strict_json import check_text
from dcp_plus.writers.layout import FilePlan

log = logging.getLogger(__name__)

TABLE_FQN = "__dcp_plus_extent_table__"
Fence = Callable[[], None]
"""Raises when this writer may no longer write where it is (``CheckpointManager``'s lease)."""


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Set on each rank's plan by the coordinator: its rank and the world size.

    It carries no save id: DCP's plan caching reuses a cached final plan (and this) without
    calling ``prepare_global_plan``, so each rank picks its save's id itself, every save.
    """

    rank: int
    world: int = 1


@dataclasses.dataclass(frozen=True)
class ExtentTableRef:
    """The one write result a rank sends in a multi-rank save: where its extents are."""

    name: str
    checksum: str
    count: int


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def is_url(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def extent_table_name(rank: int, save_id: str) -> str:
    return f"__{rank}.{save_id}.extents"


class CommittingWriter(StorageWriter):
    """Base of writers whose coordinator commits one record of every rank's extents.

    In a multi-rank save each rank stores its extent table next to its data and returns a
    single :class:`ExtentTableRef`, so DCP's gather of write results carries O(1) bytes per
    rank whatever the tensor count; the coordinator reads the tables back in ``finish``,
    writes the record, and (``overwrite=True``) then removes the data files of the record it
    replaced, and only those: files of any other save (one still running, or one that
    crashed) are never touched. Subclasses provide the storage hooks below.
    """

    save_id: str
    rank: int
    overwrite: bool
    fence: Fence | None = None
    is_coordinator: bool = True
    _transient: tuple[str, ...] = ()
    """Attributes dropped when DCP pickles the writer into its PROCESS-mode daemon."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._transient:
            state[name] = None
        return state

    def _exists_message(self) -> str:
        return (f"{self.checkpoint_id} already holds a committed checkpoint; pass overwrite=True "
                "to replace it (the old one stays loadable until the new one commits) or save "
                "to a new location")

    @property
    @abc.abstractmethod
    def checkpoint_id(self) -> str: ...

    # -- storage hooks ----------------------------------------------------------------------

    @abc.abstractmethod
    def _put_table(self, name: str, data: bytes) -> None:
        """Store a rank's extent table ``name`` (read back by the coordinator)."""

    @abc.abstractmethod
    def _get_table(self, name: str) -> bytes: ...

    @abc.abstractmethod
    def _delete_tables(self, names: Sequence[str]) -> None: ...

    @abc.abstractmethod
    def _committed_record(self) -> bytes | None:
        """The bytes of the commit record now in place, None if there is none."""

    @abc.abstractmethod
    def _commit(self, record: bytes) -> None:
        """Put the commit record in place atomically (the checkpoint exists from then on).

        Raises:
            CheckpointExistsError: a record appeared meanwhile and ``overwrite`` is off.
        """

    @abc.abstractmethod
    def _delete_data(self, names: Sequence[str]) -> None:
        """Remove data files ``names`` (already gone ones are no error)."""

    # -- StorageWriter ----------------------------------------------------------------------

    def _set_up(self, is_coordinator: bool, kwargs: dict[str, Any]) -> None:
        """What every ``set_up_storage_writer`` does first; runs on every rank, every save."""
        if kwargs.get("use_collectives", True) is False:
            # every rank would run finish() and commit a record holding only its own items
            raise CheckpointFormatError(
                f"{self.checkpoint_id}: {type(self).__name__} needs use_collectives=True: the "
                "coordinator commits one record of every rank's data. For a single-process "
                "save use no_dist=True"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.save_id = new_save_id()
        if is_coordinator and self.fence is not None:
            self.fence()  # before anything is written (DCP hands the error to every rank)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=RankInfo(i, len(plans)))
                for i, p in enumerate(plans)]

    def _plan_info(self, plan: SavePlan) -> RankInfo:
        info = plan.storage_data
        return info if isinstance(info, RankInfo) else RankInfo(self.rank)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        extents, tables = self._collect(metadata, results)
        record = encode_record(metadata, extents)
        replaced = self._replaced_files() if self.overwrite else set()
        if self.fence is not None:
            self.fence()  # a writer fenced off while this save ran must not commit it
        self._commit(record)
        self._delete_tables(tables)
        stale = sorted(replaced - {e.file for e in extents.values()})
        if stale:
            self._delete_data(stale)
            log.info("%s: removed %d data files of the checkpoint this commit replaced",
                     self.checkpoint_id, len(stale))

    def _replaced_files(self) -> set[str]:
        """The data files of the record this save will replace."""
        data = self._committed_record()
        if data is None:
            return set()
        try:
            old = decode_record(data, f"{self.checkpoint_id}/.metadata")
        except DcpPlusError as e:  # a stock DCP pickle, or damaged: keep its files
            log.warning("%s: the commit record being replaced is not readable (%s); its data "
                        "files are left in place", self.checkpoint_id, e)
            return set()
        return {e.file for e in old.storage_data.values() if is_data_file(e.file)}

    @staticmethod
    def _extents(files: Sequence[FilePlan], raw_lengths: dict[int, int], codecs: dict[int, str],
                 sums: dict[int, str]) -> list[tuple[MetadataIndex, Extent]]:
        """The extents of the items placed in ``files``; raw lengths, codecs and content
        ``sums`` by ``id(item)``; checksums bound to each extent's identity (version 2)."""
        out = []
        dtype_names: dict[torch.dtype, str] = {}
        for fp in files:
            name = fp.name
            for r, off in fp.placed:
                index = r.item.index
                fqn = index.fqn
                problem = check_text(fqn)
                if problem is not None:
                    raise CheckpointFormatError(f"state dict key {fqn!r} {problem}; "
                                                "dcp_plus records keys as UTF-8 text")
                td = r.item.tensor_data
                dname = None
                if td is not None:
                    dtype = td.properties.dtype
                    dname = dtype_names.get(dtype) or dtype_names.setdefault(
                        dtype, dtype_name(dtype))
                key = id(r)
                raw_length, length, codec = raw_lengths[key], len(r.data), codecs[key]
                identity = identity_of(fqn, index.offset, dname, raw_length, length, codec,
                                       r.value)
                out.append((index, Extent(name, off, length, raw_length, codec,
                                          bind_checksum(sums[key], identity), r.value)))
        return out

    def _results(self, info: RankInfo,
                 extents: list[tuple[MetadataIndex, Extent]]) -> list[WriteResult]:
        if info.world <= 1:
            return [WriteResult(index=i, size_in_bytes=e.length, storage_data=e)
                    for i, e in extents]
        data = encode_extent_table(dict(extents))
        name = extent_table_name(info.rank, self.save_id)
        self._put_table(name, data)
        ref = ExtentTableRef(name, checksum_bytes(data), len(extents))
        return [WriteResult(index=MetadataIndex(f"{TABLE_FQN}/{info.rank}"),
                            size_in_bytes=sum(e.length for _, e in extents), storage_data=ref)]

    def _collect(self, metadata: Metadata,
                 results: list[list[WriteResult]]) -> tuple[dict[MetadataIndex, Extent], list[str]]:
        """Every rank's extents (tables read back and checked) and the table names."""
        extents: dict[MetadataIndex, Extent] = {}
        tables = []
        for rank_results in results:
            for wr in rank_results:
                ref = wr.storage_data
                if isinstance(ref, ExtentTableRef):
                    data = self._get_table(ref.name)
                    where = f"{self.checkpoint_id}/{ref.name}"
                    if checksum_bytes(data) != ref.checksum:
                        raise CheckpointFormatError(f"{where}: extent table does not match the "
                                                    "checksum its rank reported")
                    table = decode_extent_table(data, where)
                    if len(table) != ref.count:
                        raise CheckpointFormatError(f"{where}: {len(table)} extents, its rank "
                                                    f"reported {ref.count}")
                    extents.update(table)
                    tables.append(ref.name)
                else:
                    extents[wr.index] = ref
        metadata.storage_data = extents
        metadata.storage_meta = self.storage_meta()
        metadata.version = CURRENT_DCP_VERSION
        return extents, tables
