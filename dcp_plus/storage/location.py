"""Where a writer or reader points, and the store it opens there."""

from __future__ import annotations

import abc
import copy
import os
from typing import Any, Self

from dcp_plus.errors import InvalidOptionError
from dcp_plus.storage.objectio import ObjectStore
from dcp_plus.storage.urls import is_url, names_location


def normalize_location(checkpoint_id: str | os.PathLike) -> str:
    """A checkpoint's directory or URL as writers and readers keep it (no trailing ``/``).

    Raises:
        InvalidOptionError: a URL that names no location (``s3://``, ``s3:///key``).
    """
    text = os.fspath(checkpoint_id)
    if is_url(text) and not names_location(text):
        raise InvalidOptionError(f"{text!r} names no bucket or location: expected e.g. "
                                 "s3://bucket/prefix")
    where, sep, query = text.partition("?")
    return f"{where.rstrip('/') or '/'}{sep}{query}"


class StoreClient(abc.ABC):
    """``path`` (a directory or a URL; also ``url`` and DCP's ``checkpoint_id``) and the store
    open on it: opened on first use, closed by :meth:`close`, reopened after it. The store
    is never pickled (DCP's PROCESS-mode daemon reconnects)."""

    path: str
    _store_obj: ObjectStore | None = None
    _transient: tuple[str, ...] = ("_store_obj",)
    """Attributes dropped when the object is pickled."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._transient:
            state[name] = None
        return state

    @abc.abstractmethod
    def _open_store(self) -> ObjectStore:
        """The store of ``path``."""

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def url(self) -> str:
        return self.path

    @property
    def _store(self) -> ObjectStore:
        if self._store_obj is None:
            self._store_obj = self._open_store()
        return self._store_obj

    def sibling(self, name: str) -> Self:
        """A copy of this client pointing at the checkpoint ``name`` beside its own (same
        parent directory or key prefix, same settings), with a store of its own."""
        other = copy.copy(self)
        other._store_obj = None
        other.path = sibling_path(self.path, name)
        return other

    def _set_location(self, checkpoint_id: str | os.PathLike) -> None:
        """Point at ``checkpoint_id`` (the store of the old location is closed)."""
        self._close_store()
        self.path = normalize_location(checkpoint_id)

    def _close_store(self) -> None:
        if self._store_obj is not None:
            self._store_obj.close()
            self._store_obj = None


_PARENT_DEPTH = {"nfs": 2}
"""Path components (after ``scheme://``) a URL's parent keeps at least, so that a sibling
stays in the same bucket (1: ``s3://bucket``) or NFS export (2: ``nfs://host/export``)."""


def _parent(where: str) -> str:
    """The parent location of ``where`` (no query); refused where a sibling would leave the
    bucket or export.

    Raises:
        InvalidOptionError: ``where`` is a bucket's or an export's root.
    """
    scheme, sep, rest = where.partition("://")
    if sep and len([c for c in rest.split("/") if c]) - 1 < _PARENT_DEPTH.get(scheme, 1):
        raise InvalidOptionError(
            f"{where}: incremental checkpoints reference checkpoints beside them, in the same "
            "bucket or export; put this one below a key prefix or a directory")
    return where.rstrip("/").rpartition("/")[0]


def sibling_path(path: str, name: str) -> str:
    """The location of checkpoint ``name`` beside ``path`` (a directory or a URL; a URL's
    query, e.g. ``nfs://...?version=4.1``, is kept).

    Raises:
        InvalidOptionError: ``path`` is a bucket's or an export's root.
    """
    where, sep, query = path.partition("?")
    if "/" not in where:
        return f"{name}{sep}{query}"
    return f"{_parent(where)}/{name}{sep}{query}"


def sibling_name(path: str, other: str | os.PathLike) -> str:
    """``other``'s name if it lies beside ``path`` (both normalized locations).

    Raises:
        InvalidOptionError: ``other`` lies elsewhere (references never leave a checkpoint's
            parent directory, so that a record cannot point at arbitrary files).
    """
    text = normalize_location(other).partition("?")[0].rstrip("/")
    here = path.partition("?")[0].rstrip("/")
    if not is_url(text) and not is_url(here):
        text, here = os.path.abspath(text), os.path.abspath(here)
    name = text.rpartition("/")[2]
    if text.rpartition("/")[0] != _parent(here) or not name or name == here.rpartition("/")[2]:
        raise InvalidOptionError(
            f"base {os.fspath(other)!r} must be another checkpoint in the same directory as "
            f"{path!r} (incremental checkpoints reference their bases by name)")
    return name
