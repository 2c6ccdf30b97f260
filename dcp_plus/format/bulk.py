"""DCP's per-item objects built in bulk: a record of 100,000 tensors needs as many
``MetadataIndex`` and ``Extent`` objects, and their constructors (a ``torch.Size`` copy per
index, a Python ``__new__`` per named tuple) were a third of its decode."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.format.extent import Extent

_INDEX_FIELDS = ("fqn", "offset", "index")
# MetadataIndex is a frozen dataclass whose __init__ copies the offsets into a new
# torch.Size; filling the instance's __dict__ directly keeps the Size given (an immutable
# tuple) and runs no Python code per item. Only where the class is the one this assumes.
_DIRECT = (tuple(getattr(MetadataIndex, "__dataclass_fields__", ())) == _INDEX_FIELDS
           and not hasattr(MetadataIndex, "__slots__")
           and not hasattr(MetadataIndex, "__post_init__"))


def metadata_indexes(fqns: Sequence[str], offsets: Iterable[torch.Size | None]
                     ) -> list[MetadataIndex]:
    """``[MetadataIndex(f, o) for f, o in zip(fqns, offsets)]``, equal and equally hashed,
    built in bulk. Each offset must be a ``torch.Size`` or None (the caller's; shared, not
    copied)."""
    if not _DIRECT:
        return list(map(MetadataIndex, fqns, offsets))
    out = list(map(object.__new__, itertools.repeat(MetadataIndex, len(fqns))))
    states = [{"fqn": f, "offset": o, "index": None} for f, o in zip(fqns, offsets, strict=True)]
    deque(map(object.__setattr__, out, itertools.repeat("__dict__"), states), maxlen=0)
    return out


def extents(*columns: Iterable[object]) -> list[Extent]:
    """One :class:`Extent` per row of ``columns`` (the fields in order, all ten), without
    the named tuple's Python ``__new__``."""
    return list(map(tuple.__new__, itertools.repeat(Extent),  # type: ignore[arg-type]
                    zip(*columns, strict=True)))


__all__ = ["extents", "metadata_indexes"]
