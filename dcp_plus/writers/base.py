"""What every dcp_plus writer shares: per-save ids, per-rank plan info, and the O(1)
write-result exchange through per-rank extent tables."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.checksum import checksum_bytes
from dcp_plus.format.record import Extent, decode_extent_table, encode_extent_table

TABLE_FQN = "__dcp_plus_extent_table__"


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Set on each rank's plan by the coordinator: its rank, the save id, the world size."""

    rank: int
    save_id: str
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
    rank whatever the tensor count; the coordinator reads the tables back in ``finish``.
    Subclasses provide ``_put_table``/``_get_table``/``_delete_tables`` for their storage.
    """

    save_id: str
    rank: int
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
    def checkpoint_id(self) -> str:
        raise NotImplementedError

    def _put_table(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def _get_table(self, name: str) -> bytes:
        raise NotImplementedError

    def _delete_tables(self, names: Sequence[str]) -> None:
        raise NotImplementedError

    def _refuse_without_collectives(self, kwargs: dict[str, Any]) -> None:
        if kwargs.get("use_collectives", True) is False:
            # every rank would run finish() and commit a record holding only its own items
            raise CheckpointFormatError(
                f"{self.checkpoint_id}: {type(self).__name__} needs use_collectives=True: the "
                "coordinator commits one record of every rank's data. For a single-process "
                "save use no_dist=True"
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.save_id = new_save_id()  # the coordinator records the id its data files carry
        return [dataclasses.replace(p, storage_data=RankInfo(i, self.save_id, len(plans)))
                for i, p in enumerate(plans)]

    def _plan_info(self, plan: SavePlan) -> RankInfo:
        info = plan.storage_data
        return info if isinstance(info, RankInfo) else RankInfo(self.rank, self.save_id)

    def _results(self, info: RankInfo,
                 extents: list[tuple[MetadataIndex, Extent]]) -> list[WriteResult]:
        if info.world <= 1:
            return [WriteResult(index=i, size_in_bytes=e.length, storage_data=e)
                    for i, e in extents]
        data = encode_extent_table(dict(extents))
        name = extent_table_name(info.rank, info.save_id)
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
