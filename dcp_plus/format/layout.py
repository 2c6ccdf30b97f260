"""Extent alignment and data-file naming."""

from __future__ import annotations

import re

ALIGNMENT = 4096
DATA_SUFFIX = ".dcpp"
MAX_RECORD_BYTES = 1 << 30
"""No commit record or extent table is larger (a million tensors take ~300 MB); a larger
file is not read."""


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def data_file_name(rank: int, k: int, save_id: str) -> str:
    """``__{rank}_{k}.{save_id}.dcpp``: unique per save, so no commit's file is overwritten."""
    return f"__{rank}_{k}.{save_id}{DATA_SUFFIX}"


_DATA_FILE = re.compile(r"^__\d+_\d+\.[0-9a-f]+" + re.escape(DATA_SUFFIX) + "$")


def is_data_file(name: str) -> bool:
    """Whether ``name`` is a data file name :func:`data_file_name` makes."""
    return _DATA_FILE.match(name) is not None


def extent_table_name(rank: int, save_id: str) -> str:
    """``__{rank}.{save_id}.extents``: a rank's extents until the commit (removed after)."""
    return f"__{rank}.{save_id}.extents"


_EXTENT_TABLE = re.compile(r"^__\d+\.[0-9a-f]+\.extents$")


def is_save_file(name: str) -> bool:
    """Whether ``name`` is one a save writes beside its commit record: a data file or an
    extent table."""
    return is_data_file(name) or _EXTENT_TABLE.match(name) is not None
