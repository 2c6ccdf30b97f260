"""Pointing a reader's store at the key prefixes a record names for its data objects."""

from __future__ import annotations

from collections.abc import Mapping

from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.errors import CheckpointFormatError
from dcp_plus.format.record import Extent
from dcp_plus.storage.objectio import ObjectStore
from dcp_plus.storage.placement import Placed


def place_objects(store: ObjectStore, extents: Mapping[MetadataIndex, Extent],
                  record: str) -> None:
    """Tell ``store`` where the prefixed objects of ``extents`` lie (each prefix was
    validated with the record ``record``).

    Raises:
        CheckpointFormatError: prefixes where the store has none, or a location with no
            key below its bucket.
    """
    placed = {e.file: e.prefix for e in extents.values() if e.prefix is not None}
    if not placed:
        return
    if not isinstance(store, Placed):
        raise CheckpointFormatError(f"{record}: its data objects lie under key prefixes of an "
                                    "object store; read it with ObjectStoreReader at its URL")
    try:
        store.place(placed)
    except ValueError as e:
        raise CheckpointFormatError(f"{record}: {e}") from None
