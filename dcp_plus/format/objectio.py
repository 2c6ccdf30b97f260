"""Object I/O for any fsspec URL: whole-object uploads, coalesced ranged reads, bounded retries.

:func:`open_store` picks :class:`~dcp_plus.format.s3io.S3Store` (parallel multipart uploads and
ranged GETs on s3fs's event loop) for ``s3://`` and :class:`FsspecStore` (threads over the
generic fsspec API) for everything else (``memory://``, ``file://``, ``gs://``...). Endpoints
and credentials only ever come from fsspec ``storage_options``.

Both stores see an object as ``segments``: ``(offset, bytes)`` pairs, zero-filled between.
"""

from __future__ import annotations

import bisect
import math
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from dcp_plus.format.retry import RetryPolicy, retry_sync

Segments = Sequence[tuple[int, memoryview]]
MIN_PART_SIZE = 5 << 20  # S3's smallest part (but the last)
MAX_PARTS = 10_000


@dataclass(frozen=True)
class StoreConfig:
    """Transfer tuning shared by writers and readers.

    Attributes:
        part_size: bytes per multipart-upload part (>= 5 MiB on S3).
        concurrency: requests in flight per process.
        retry: backoff policy for throttling, 5xx and connection failures.
        coalesce_gap: ranged reads of extents at most this far apart are merged.
        range_size: the largest single ranged GET; longer runs are split and read in parallel.
    """

    part_size: int = 16 << 20
    concurrency: int = 8
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    coalesce_gap: int = 1 << 20
    range_size: int = 16 << 20

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.part_size < 1 or self.range_size < 1 or self.coalesce_gap < 0:
            raise ValueError(f"invalid transfer sizes: {self}")


class ObjectStore(Protocol):
    """The few operations a checkpoint needs from a prefix of an object store."""

    url: str

    def location(self, name: str) -> str: ...

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]: ...

    def get(self, name: str) -> bytes | None: ...

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool: ...

    def upload(self, objects: Sequence[tuple[str, Segments, int]]) -> None: ...

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None: ...

    def list(self) -> list[str]: ...

    def delete(self, names: Sequence[str]) -> None: ...

    def close(self) -> None: ...


_ZEROS = memoryview(bytes(1 << 16))


def assemble(segments: Segments, starts: Sequence[int], start: int, end: int) -> bytes:
    """The object bytes ``[start, end)``: segment data, zeros between (``starts`` is sorted).

    One copy, straight into a new ``bytes``: no zero-filled buffer first, and HTTP clients
    send ``bytes`` without copying them again (aiohttp slices a ``bytearray`` body).
    """
    pieces: list[memoryview] = []
    pos = start
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(segments) and segments[i][0] < end:
        off, data = segments[i]
        a, b = max(off, pos), min(off + len(data), end)
        if a < b:
            _zeros(pieces, a - pos)
            pieces.append(data[a - off : b - off])
            pos = b
        i += 1
    _zeros(pieces, end - pos)
    return b"".join(pieces)


def _zeros(pieces: list[memoryview], n: int) -> None:
    while n > 0:
        take = min(n, len(_ZEROS))
        pieces.append(_ZEROS[:take])
        n -= take


def part_bounds(total: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each multipart part (grown so that at most 10,000 are needed)."""
    size = max(part_size, math.ceil(total / MAX_PARTS))
    return [(a, min(a + size, total)) for a in range(0, total, size)]


def plan_ranges(reads: Sequence[tuple[int, memoryview]], gap: int,
                max_len: int) -> list[tuple[int, list[memoryview]]]:
    """Group ``(offset, buffer)`` reads into ranged requests ``(start, buffers)``.

    Neighbours at most ``gap`` bytes apart share a request (the gap is read into scratch);
    runs longer than ``max_len`` are cut into several requests. The buffers of a request are
    contiguous: they fill ``[start, start + sum(len))`` in order.
    """
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for off, view in sorted(((o, v) for o, v in reads if len(v)), key=lambda r: r[0]):
        if runs and end <= off <= end + gap:
            if off > end:
                runs[-1][1].append(memoryview(bytearray(off - end)))
            runs[-1][1].append(view)
        else:
            runs.append((off, [view]))
        end = off + len(view)
    out: list[tuple[int, list[memoryview]]] = []
    for start, views in runs:
        cur: list[memoryview] = []
        cur_start, cur_len = start, 0
        for view in views:
            while len(view):
                take = min(len(view), max_len - cur_len)
                cur.append(view[:take])
                view = view[take:]
                cur_len += take
                if cur_len == max_len:
                    out.append((cur_start, cur))
                    cur_start, cur, cur_len = cur_start + cur_len, [], 0
        if cur:
            out.append((cur_start, cur))
    return out


def fill(views: list[memoryview], data: bytes | memoryview, what: str) -> None:
    """Copy ``data`` into consecutive ``views``; a short ``data`` raises EOFError."""
    need = sum(len(v) for v in views)
    if len(data) < need:
        raise EOFError(f"{what}: object ends {need - len(data)} bytes early")
    pos = 0
    for v in views:
        v[:] = data[pos : pos + len(v)]
        pos += len(v)


def open_store(url: str, storage_options: dict[str, Any] | None,
               config: StoreConfig) -> ObjectStore:
    """The store for ``url``'s prefix; ``storage_options`` go to fsspec untouched."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if {"s3", "s3a"} & set(protocols) and hasattr(fs, "set_session"):
        from dcp_plus.format.s3io import S3Store

        return S3Store(fs, root, url, config)
    return FsspecStore(fs, root, url, config)


class FsspecStore:
    """Any fsspec filesystem: objects written as streams, ranges read with ``cat_file``."""

    def __init__(self, fs: Any, root: str, url: str, config: StoreConfig) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.config = config
        self._pool: ThreadPoolExecutor | None = None

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _map(self, fn: Any, args: Sequence[Any]) -> list[Any]:
        if len(args) <= 1:
            return [fn(a) for a in args]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.concurrency,
                                            thread_name_prefix="dcpp-objio")
        futures = [self._pool.submit(fn, a) for a in args]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures]

    def _retry(self, fn: Any, what: str) -> Any:
        return retry_sync(fn, self.config.retry, what)

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]:
        def size(name: str) -> int | None:
            def attempt(_: int) -> int | None:
                try:
                    return int(self.fs.size(self._path(name)))
                except FileNotFoundError:
                    return None
            return self._retry(attempt, f"size of {self.location(name)}")
        return dict(zip(names, self._map(size, list(names)), strict=True))

    def get(self, name: str) -> bytes | None:
        def attempt(_: int) -> bytes | None:
            try:
                return bytes(self.fs.cat_file(self._path(name)))
            except FileNotFoundError:
                return None
        return self._retry(attempt, f"GET {self.location(name)}")

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool:
        # Generic filesystems have no conditional create: check, then write.
        if if_absent and self.sizes([name])[name] is not None:
            return False
        self._ensure_root()
        self._retry(lambda _: self.fs.pipe_file(self._path(name), data),
                    f"PUT {self.location(name)}")
        return True

    def _ensure_root(self) -> None:
        # Directory-backed filesystems need the directory; object stores have none.
        if not getattr(self.fs, "async_impl", False):
            self.fs.makedirs(self.root, exist_ok=True)

    def upload(self, objects: Sequence[tuple[str, Segments, int]]) -> None:
        self._ensure_root()

        def one(obj: tuple[str, Segments, int]) -> None:
            name, segments, total = obj
            starts = [off for off, _ in segments]
            bounds = part_bounds(total, self.config.part_size)

            def attempt(_: int) -> None:
                with self.fs.open(self._path(name), "wb") as f:
                    for a, b in bounds:
                        f.write(assemble(segments, starts, a, b))
            self._retry(attempt, f"upload of {self.location(name)}")
        self._map(one, list(objects))

    def read(self, name: str, reads: Sequence[tuple[int, memoryview]]) -> None:
        what = self.location(name)

        def one(rng: tuple[int, list[memoryview]]) -> None:
            start, views = rng
            end = start + sum(len(v) for v in views)

            def attempt(_: int) -> None:
                fill(views, self.fs.cat_file(self._path(name), start, end), what)
            self._retry(attempt, f"GET {what} bytes {start}..{end}")
        self._map(one, plan_ranges(reads, self.config.coalesce_gap, self.config.range_size))

    def list(self) -> list[str]:
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(p.rstrip("/")) for p in paths]

    def delete(self, names: Sequence[str]) -> None:
        if names:
            self.fs.rm([self._path(n) for n in names])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
