"""URL helpers shared by every layer."""

from __future__ import annotations

import os


def is_url(path: str | os.PathLike) -> bool:
    return "://" in str(path)


def is_nfs_target(target: str | os.PathLike) -> bool:
    """A mounted path (no URL scheme) or an ``nfs://`` URL."""
    return str(target).startswith("nfs://") or not is_url(target)


def normalize_location(checkpoint_id: str | os.PathLike) -> str:
    """A checkpoint's directory or URL as writers and readers keep it (no trailing ``/``)."""
    return os.fspath(checkpoint_id).rstrip("/") or "/"


class CheckpointLocation:
    """Where a writer or reader points: ``path`` (a directory or a URL), also ``url`` and
    DCP's ``checkpoint_id``."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def url(self) -> str:
        return self.path

    def _set_location(self, checkpoint_id: str | os.PathLike) -> None:
        self.path = normalize_location(checkpoint_id)
