"""Any fsspec filesystem as an object store: threads over the generic fsspec API."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from dcp_plus.format.key_prefix import insert_prefix
from dcp_plus.storage.fanout import Threads, windowed
from dcp_plus.storage.http_errors import HTTP_ERRORS
from dcp_plus.storage.placement import Placed
from dcp_plus.storage.ranged import (
    ExtentFill,
    RangeRequest,
    ReadsByExtents,
    Segments,
    StoreConfig,
    assemble,
    check_small,
    fill,
    part_bounds,
    plan_requests,
)
from dcp_plus.storage.rate import GRANT, Bucket
from dcp_plus.storage.retry import Retry


class FsspecStore(Placed, ReadsByExtents):
    """Any fsspec filesystem: objects written as streams, ranges read with ``cat_file``."""

    uploads_from_any_process = False  # kept in-process: memory:// is per process

    def __init__(self, fs: Any, root: str, url: str, config: StoreConfig) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.config = config
        self._threads = Threads(config.concurrency, "dcpp-objio")
        self._retry = Retry(config.retry, HTTP_ERRORS)

    def _path(self, name: str) -> str:
        prefix = self.prefix_of(name)
        return f"{self.root if prefix is None else insert_prefix(self.root, prefix)}/{name}"

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]:
        def size(name: str) -> int | None:
            def attempt(_: int) -> int | None:
                try:
                    return int(self.fs.size(self._path(name)))
                except FileNotFoundError:
                    return None
            return self._retry.call(attempt, f"size of {self.location(name)}")
        return dict(zip(names, self._threads.map(size, list(names)), strict=True))

    def get(self, name: str) -> bytes | None:
        def attempt(_: int) -> bytes | None:
            try:
                check_small(self.location(name), int(self.fs.size(self._path(name))))
                return bytes(self.fs.cat_file(self._path(name)))
            except FileNotFoundError:
                return None
        return self._retry.call(attempt, f"GET {self.location(name)}")

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool:
        # Generic filesystems have no conditional create: check, then write.
        if if_absent and self.sizes([name])[name] is not None:
            return False
        self._ensure_root([name])
        self._retry.call(lambda _: self.fs.pipe_file(self._path(name), data),
                    f"PUT {self.location(name)}")
        return True

    def _ensure_root(self, names: Sequence[str]) -> None:
        # Directory-backed filesystems need the directories; object stores have none.
        if not getattr(self.fs, "async_impl", False):
            for folder in {posixpath.dirname(self._path(n)) for n in names}:
                self.fs.makedirs(folder, exist_ok=True)

    def upload(self, objects: Sequence[tuple[str, Segments, int]],
               pace: Bucket | None = None) -> None:
        self._ensure_root([name for name, _, _ in objects])

        def one(obj: tuple[str, Segments, int]) -> None:
            name, segments, total = obj
            starts = [off for off, _ in segments]
            # paced: a stream is written in grants (a store buffering blocks sends blocks)
            bounds = part_bounds(total, self.config.part_size if pace is None else GRANT)

            def attempt(_: int) -> None:
                with self.fs.open(self._path(name), "wb") as f:
                    for a, b in bounds:
                        if pace is not None:
                            pace.take(b - a)
                        f.write(assemble(segments, starts, a, b))
            self._retry.call(attempt, f"upload of {self.location(name)}")
        self._threads.map(one, list(objects))

    def read_extents(self, extents: Sequence[tuple[str, int, int]],
                     open_extent: Callable[[int], memoryview], done: Callable[[int], None],
                     executor: Executor | None = None) -> None:
        requests = plan_requests(extents, self.config.coalesce_gap, self.config.range_size)
        book = ExtentFill(requests, open_extent)

        def deliver(ks: list[int]) -> None:
            for k in ks:
                done(k)

        def one(req: RangeRequest, views: list[memoryview]) -> None:
            what, end = self.location(req.name), req.start + req.length

            def attempt(_: int) -> None:
                fill(views, self.fs.cat_file(self._path(req.name), req.start, end), what)
            self._retry.call(attempt, f"GET {what} bytes {req.start}..{end}")
            finished = book.finished(req)
            if executor is None:
                deliver(finished)
            elif finished:
                executor.submit(deliver, finished).result()

        # a slot covers delivery too (== the pool's threads): buffers never pile up
        windowed(requests, book.views, one, self._threads, self.config.concurrency)

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
        self._threads.close()
