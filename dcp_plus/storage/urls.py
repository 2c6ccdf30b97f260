"""Telling URLs from local paths."""

from __future__ import annotations

import os
import re

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # RFC 3986 scheme, then "//"


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` (``s3://b/k``, ``nfs://h/e``, ``memory://x``), False for a
    local path (a ``pathlib.Path`` is always local)."""
    return isinstance(path, str) and _SCHEME.match(path) is not None


_BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
"""Schemes whose first component is a bucket or container: without one, nothing is named."""


def names_location(url: str) -> bool:
    """Whether URL ``url`` names somewhere to keep a checkpoint: a bucket for object stores
    (``s3://`` and ``s3:///`` name none), a non-empty path otherwise."""
    if not is_url(url):
        return False
    scheme, rest = url.split("://", 1)
    if scheme.lower() in _BUCKETED:
        return rest.split("/", 1)[0] != ""
    return rest.strip("/") != ""


def prefixable(url: str) -> bool:
    """Whether key prefixes can be put before URL ``url``'s key: an object store's (or
    ``memory://``, for tests), not a file system's."""
    return is_url(url) and url.split("://", 1)[0].lower() in _BUCKETED | {"memory"}


def is_nfs_target(target: str | os.PathLike[str]) -> bool:
    """A mounted path (no URL scheme) or an ``nfs://`` URL."""
    return str(target).startswith("nfs://") or not is_url(target)
