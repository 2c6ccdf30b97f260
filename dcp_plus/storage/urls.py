"""URL helpers shared by every layer."""

from __future__ import annotations

import os


def is_url(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def is_nfs_target(target: str | os.PathLike) -> bool:
    """A mounted path (no URL scheme) or an ``nfs://`` URL."""
    return str(target).startswith("nfs://") or not is_url(target)
