"""The stand-in for a refused commit record (see ``ExtentReader.read_metadata``)."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata


class RefusedRecord(Metadata):
    """Stands for a record :meth:`ExtentReader.read_metadata` refused: reading any field of
    it raises that refusal."""

    def __init__(self, refusal: Exception) -> None:  # no fields: each one would raise
        object.__setattr__(self, "refusal", refusal)

    def __getattribute__(self, name: str) -> Any:
        if name in Metadata.__dataclass_fields__:
            raise object.__getattribute__(self, "refusal")
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return f"RefusedRecord({self.refusal!r})"
