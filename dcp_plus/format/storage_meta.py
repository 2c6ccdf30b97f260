"""The ``StorageMeta`` of a dcp_plus writer: it says the writer never pickles ``Metadata``."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import StorageMeta


class JsonRecordStorageMeta(StorageMeta):
    """``StorageMeta`` from a writer whose commit record is JSON, never a pickle of ``Metadata``.

    DCP hands a planner the writer's ``storage_meta()`` in ``set_up_planner``; this type tells
    :class:`~dcp_plus.planners.CachedSavePlanner` that no commit record will pickle the save's
    ``Metadata`` before DCP broadcasts it. It is recorded as any ``StorageMeta`` (the JSON
    record is unchanged and decodes to a plain ``StorageMeta``), compares equal to a plain one
    with the same fields, and pickles as a plain one, so that nothing pickled with it needs
    dcp_plus to load.
    """

    def _fields(self) -> tuple[Any, ...]:
        return (self.checkpoint_id, self.save_id, self.load_id, self.modules)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StorageMeta):
            return NotImplemented
        return self._fields() == (other.checkpoint_id, other.save_id, other.load_id,
                                  other.modules)

    __hash__ = None  # type: ignore[assignment]  # as StorageMeta's (a mutable dataclass)

    def __reduce__(self) -> tuple[type[StorageMeta], tuple[Any, ...]]:
        return (StorageMeta, self._fields())


__all__ = ["JsonRecordStorageMeta"]
