"""ObjectStoreReader: a DCP ``StorageReader`` for dcp_plus checkpoints at any fsspec URL."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus._compat.torch_dcp import fsspec_reader
from dcp_plus.readers.base import ExtentReader
from dcp_plus.storage.objectio import ObjectStore, StoreConfig, open_store
from dcp_plus.storage.retry import RetryPolicy
from dcp_plus.storage.urls import names_location


class ObjectStoreReader(ExtentReader):
    """Parallel, checksum-verifying reader of checkpoints written by ``ObjectStoreWriter``.

    Extents of one object are sorted and coalesced (gaps up to ``coalesce_gap``), cut into
    ranged GETs at the multiples of ``range_size`` bytes, fetched ``concurrency`` at a time
    (one pipeline over all objects) and streamed straight into the destination tensors;
    each extent's checksum is verified, on one of ``threads`` threads, as soon as its bytes
    are in, before the planner sees the tensor. Supports resharding like
    :class:`~dcp_plus.readers.LocalReader`.

    Args:
        url: checkpoint prefix, e.g. ``"s3://bucket/run/step_100"``.
        storage_options: passed to fsspec untouched (endpoint, credentials...).
        verify: check every extent's checksum while loading (default on).
        concurrency: ranged requests in flight.
        threads: extents verified and delivered in parallel (while the next GETs run).
        coalesce_gap: extents at most this many bytes apart share a request.
        range_size: the largest single ranged GET; GETs are cut at its multiples, so keep it
            a multiple or a divisor of the writer's part_size (both default to 32 MiB).
        max_retries, retry_base_delay, retry_max_delay: as for ``ObjectStoreWriter``.
        allow_pickle: also load checkpoints written by stock ``FsspecWriter`` (pickled
            ``.metadata``: only for checkpoints you trust).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 verify: bool = True, concurrency: int = 8, threads: int = 4,
                 coalesce_gap: int = 1 << 20, range_size: int = 32 << 20,
                 max_retries: int = 5, retry_base_delay: float = 0.2,
                 retry_max_delay: float = 10.0, allow_pickle: bool = False) -> None:
        super().__init__(url, verify=verify, threads=threads, allow_pickle=allow_pickle)
        self.storage_options = dict(storage_options or {})
        self.config = StoreConfig(concurrency=concurrency, coalesce_gap=coalesce_gap,
                                  range_size=range_size,
                                  retry=RetryPolicy(max_retries, retry_base_delay,
                                                    retry_max_delay))

    def _open_store(self) -> ObjectStore:
        return open_store(self.path, self.storage_options, self.config)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str) and names_location(checkpoint_id)

    def _stock_reader(self) -> StorageReader:
        return fsspec_reader()(self.path, **self.storage_options)  # type: ignore[no-any-return]
