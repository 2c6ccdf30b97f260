"""Extent alignment and data-file naming."""

from __future__ import annotations

ALIGNMENT = 4096
DATA_SUFFIX = ".dcpp"


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def data_file_name(rank: int, k: int, save_id: str) -> str:
    """``__{rank}_{k}.{save_id}.dcpp``: unique per save, so no commit's file is overwritten."""
    return f"__{rank}_{k}.{save_id}{DATA_SUFFIX}"
