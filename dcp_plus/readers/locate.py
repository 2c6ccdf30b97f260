"""The dcp_plus reader for a checkpoint location: a local path, ``nfs://`` or an fsspec URL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dcp_plus.errors import DcpPlusError
from dcp_plus.readers.base import ExtentReader
from dcp_plus.storage.urls import is_url


def reader_for(location: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
               *, allow_pickle: bool = False) -> ExtentReader:
    """:class:`~dcp_plus.NFSReader` for ``nfs://``, :class:`~dcp_plus.ObjectStoreReader` for
    other URLs (``s3://``, ``gs://``, ``file://``...), :class:`~dcp_plus.LocalReader` for
    paths. ``storage_options`` go to the URL's client; a local path takes none.
    ``allow_pickle``: as the readers take it (stock DCP checkpoints you trust)."""
    text = os.fspath(location)
    options = dict(storage_options or {})
    if text.startswith("nfs://"):
        from dcp_plus.readers.nfs import NFSReader

        return NFSReader(text, options, allow_pickle=allow_pickle)
    if is_url(text):
        from dcp_plus.readers.object_store import ObjectStoreReader

        return ObjectStoreReader(text, options, allow_pickle=allow_pickle)
    if options:
        raise DcpPlusError(f"{text}: storage options ({', '.join(sorted(options))}) apply to "
                           "URLs only, not to a local path")
    from dcp_plus.readers.local import LocalReader

    return LocalReader(text, allow_pickle=allow_pickle)
