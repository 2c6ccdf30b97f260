"""S3 object I/O on s3fs's event loop: parallel multipart uploads and ranged GETs.

Requests go to the aiobotocore client that s3fs builds from ``storage_options`` (endpoint,
credentials, botocore ``config_kwargs``), bypassing s3fs's own retry layer so that the retry
bound is :class:`~dcp_plus.storage.retry.RetryPolicy`'s, with
:data:`~dcp_plus.storage.http_errors.HTTP_ERRORS` telling which errors to retry (botocore's
retry configuration still applies beneath it). ``s3fs``'s ``requester_pays`` and
``s3_additional_kwargs`` (e.g. SSE) are honoured on the calls that create objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

from fsspec.asyn import sync

from dcp_plus.storage.http_errors import HTTP_ERRORS, error_status
from dcp_plus.storage.placement import Placed
from dcp_plus.storage.ranged import (
    MIN_PART_SIZE,
    ExtentFill,
    RangeRequest,
    ReadsByExtents,
    Segments,
    StoreConfig,
    assemble,
    check_small,
    part_bounds,
    plan_requests,
)
from dcp_plus.storage.rate import Bucket
from dcp_plus.storage.retry import Retry

log = logging.getLogger(__name__)
T = TypeVar("T")


async def gather_or_cancel(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run ``coros`` (or tasks) concurrently; on the first failure cancel the rest, raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


async def _read_into(body: Any, views: list[memoryview]) -> int:
    """Fill consecutive ``views`` from a response body; returns the bytes filled (short only
    at end of stream).

    With aiohttp underneath, each network chunk is copied once, straight into the views
    (``readinto`` would join the buffered chunks into a new ``bytes`` first).
    """
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    readchunk = getattr(content, "readchunk", None)
    total = 0
    if readchunk is None:
        for view in views:
            filled = 0
            while filled < len(view):
                n = await body.readinto(view[filled:])
                if n == 0:
                    return total + filled
                filled += n
            total += filled
        return total
    i, filled = 0, 0
    while i < len(views):
        data, end_of_http_chunk = await readchunk()
        if not data:
            if end_of_http_chunk:
                continue
            return total
        chunk = memoryview(data)
        pos = 0
        while pos < len(chunk) and i < len(views):
            view = views[i]
            take = min(len(view) - filled, len(chunk) - pos)
            view[filled : filled + take] = chunk[pos : pos + take]
            pos += take
            filled += take
            total += take
            if filled == len(view):
                i, filled = i + 1, 0
    return total


async def _unless_missing(request: Awaitable[Any]) -> Any:
    """The response to ``request``, or None if the object does not exist."""
    try:
        return await request
    except Exception as e:
        status, code = error_status(e)
        if status == 404 or code in ("NoSuchKey", "404", "NotFound"):
            return None
        raise


async def _paced(pace: Bucket | None, n: int) -> None:
    if pace is not None:
        wait = pace.reserve(n)
        if wait > 0:
            await asyncio.sleep(wait)


class S3Store(Placed, ReadsByExtents):
    """One ``s3://bucket/prefix``; every request is bounded by ``config.concurrency``."""

    uploads_from_any_process = True

    def __init__(self, fs: Any, root: str, url: str, config: StoreConfig) -> None:
        if config.part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size {config.part_size} is below S3's minimum part size "
                             f"{MIN_PART_SIZE} (5 MiB)")
        self.fs = fs
        self.bucket, key, _ = fs.split_path(root)
        self.prefix = key.rstrip("/")
        self.url = url.rstrip("/")
        self.config = config
        self._sem: asyncio.Semaphore | None = None
        self._retry = Retry(config.retry, HTTP_ERRORS)
        self._create_kw = {**fs.s3_additional_kwargs, **fs.req_kw}

    def key(self, name: str) -> str:
        placed = self.prefix_of(name)  # place() refused a checkpoint with no key
        if placed is not None:
            return f"{placed}/{self.prefix}/{name}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return sync(self.fs.loop, fn, *args)

    async def _request(self, what: str, fn: Callable[[Any, int], Awaitable[T]]) -> T:
        """``fn(client, attempt)`` under the concurrency bound, retried per the policy."""
        client = await self.fs.set_session()
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.concurrency)
        sem = self._sem

        async def attempt(n: int) -> T:
            async with sem:
                return await fn(client, n)
        return await self._retry.acall(attempt, what)

    async def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        return await self._request(
            what, lambda client, _: getattr(client, method)(Bucket=self.bucket, **kwargs))

    # -- metadata ---------------------------------------------------------------------------

    def sizes(self, names: Sequence[str]) -> dict[str, int | None]:
        async def size(name: str) -> int | None:
            async def head(client: Any, _: int) -> int | None:
                resp = await _unless_missing(client.head_object(
                    Bucket=self.bucket, Key=self.key(name), **self.fs.req_kw))
                return None if resp is None else int(resp["ContentLength"])
            return await self._request(f"HEAD {self.location(name)}", head)

        async def run() -> list[int | None]:
            return await gather_or_cancel([size(n) for n in names])
        return dict(zip(names, self._run(run), strict=True))

    async def _get(self, client: Any, name: str) -> bytes | None:
        resp = await _unless_missing(client.get_object(Bucket=self.bucket, Key=self.key(name),
                                                       **self.fs.req_kw))
        if resp is None:
            return None
        async with resp["Body"] as body:
            check_small(self.location(name), int(resp.get("ContentLength") or 0))
            return bytes(await body.read())

    def get(self, name: str) -> bytes | None:
        async def run() -> bytes | None:
            return await self._request(f"GET {self.location(name)}",
                                       lambda client, _: self._get(client, name))
        return self._run(run)

    def put(self, name: str, data: bytes, *, if_absent: bool) -> bool:
        """One PUT; with ``if_absent`` it is conditional (``If-None-Match: *``).

        Returns False when ``if_absent`` and the object exists already (unless it is the
        very object an earlier attempt of this call wrote before its reply was lost).
        """
        what = f"PUT {self.location(name)}"
        cond = {"IfNoneMatch": "*"} if if_absent else {}

        async def put(client: Any, attempt: int) -> bool:
            try:
                await client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data,
                                        **cond, **self._create_kw)
                return True
            except Exception as e:
                status, code = error_status(e)
                if status == 412 or code == "PreconditionFailed":
                    return attempt > 0 and await self._get(client, name) == data
                if status == 501 and cond:
                    log.warning("%s: the store does not support If-None-Match; writing "
                                "unconditionally after checking for the object", what)
                    cond.clear()
                    if await self._get(client, name) is not None:
                        return False
                    return await put(client, attempt)
                raise

        async def run() -> bool:
            return await self._request(what, put)
        return self._run(run)

    # -- data -------------------------------------------------------------------------------

    def upload(self, objects: Sequence[tuple[str, Segments, int]],
               pace: Bucket | None = None) -> None:
        """Paced, a request waits for its whole body's share of the budget (the grain of
        the cap is ``part_size``) without blocking the event loop."""
        async def run() -> None:
            await gather_or_cancel([self._upload_one(*obj, pace) for obj in objects])
        self._run(run)

    async def _upload_one(self, name: str, segments: Segments, total: int,
                          pace: Bucket | None) -> None:
        key = self.key(name)
        starts = [off for off, _ in segments]
        bounds = part_bounds(total, self.config.part_size)
        if len(bounds) <= 1:
            await _paced(pace, total)
            body = assemble(segments, starts, 0, total)
            await self._call(f"PUT {self.location(name)}", "put_object", Key=key, Body=body,
                             **self._create_kw)
            return
        created = await self._call(f"create multipart upload of {self.location(name)}",
                                   "create_multipart_upload", Key=key, **self._create_kw)
        upload_id = created["UploadId"]
        try:
            etags = await gather_or_cancel([
                self._upload_part(name, upload_id, i + 1, segments, starts, a, b, pace)
                for i, (a, b) in enumerate(bounds)])
            parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
            await self._complete(name, upload_id, parts, total)
        except BaseException:
            await self._abort(name, upload_id)
            raise

    async def _upload_part(self, name: str, upload_id: str, number: int, segments: Segments,
                           starts: list[int], a: int, b: int, pace: Bucket | None) -> str:
        async def part(client: Any, _: int) -> str:
            await _paced(pace, b - a)  # in a request slot: parts are paced as they are sent
            body = assemble(segments, starts, a, b)  # exists only while the part is in flight
            resp = await client.upload_part(Bucket=self.bucket, Key=self.key(name),
                                            UploadId=upload_id, PartNumber=number, Body=body,
                                            **self.fs.req_kw)
            return str(resp["ETag"])
        return await self._request(f"upload of part {number} of {self.location(name)}", part)

    async def _complete(self, name: str, upload_id: str, parts: list[dict[str, Any]],
                        total: int) -> None:
        async def complete(client: Any, attempt: int) -> None:
            try:
                await client.complete_multipart_upload(
                    Bucket=self.bucket, Key=self.key(name), UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, **self.fs.req_kw)
            except Exception as e:
                # A retry after a lost reply: the upload completed and its id is gone.
                status, code = error_status(e)
                if attempt > 0 and (status == 404 or code == "NoSuchUpload"):
                    head = await client.head_object(Bucket=self.bucket, Key=self.key(name),
                                                    **self.fs.req_kw)
                    if int(head["ContentLength"]) == total:
                        return
                raise
        await self._request(f"complete multipart upload of {self.location(name)}", complete)

    async def _abort(self, name: str, upload_id: str) -> None:
        try:
            client = await self.fs.set_session()
            await client.abort_multipart_upload(Bucket=self.bucket, Key=self.key(name),
                                                UploadId=upload_id, **self.fs.req_kw)
        except Exception as e:  # best effort: a lifecycle rule reaps what is left
            log.warning("could not abort multipart upload %s of %s: %s", upload_id,
                        self.location(name), e)

    def read_extents(self, extents: Sequence[tuple[str, int, int]],
                     open_extent: Callable[[int], memoryview], done: Callable[[int], None],
                     executor: Executor | None = None) -> None:
        requests = plan_requests(extents, self.config.coalesce_gap, self.config.range_size)
        book = ExtentFill(requests, open_extent)

        def deliver(ks: list[int]) -> None:
            for k in ks:
                done(k)

        async def run() -> None:
            loop = asyncio.get_running_loop()
            window = asyncio.Semaphore(self.config.concurrency)
            tasks: list[asyncio.Future[None]] = []
            failed: list[bool] = []

            async def one(req: RangeRequest, views: list[memoryview]) -> None:
                try:
                    await self._read_range(req.name, req.start, views)
                    finished = book.finished(req)
                    if executor is None:
                        deliver(finished)
                    elif finished:  # checksums and delivery off the event loop
                        await loop.run_in_executor(executor, deliver, finished)
                finally:  # the slot covers delivery too: buffers never pile up
                    window.release()

            def note(task: asyncio.Future[None]) -> None:
                if not task.cancelled() and task.exception() is not None:
                    failed.append(True)

            try:
                for req in requests:
                    await window.acquire()
                    if failed:
                        break
                    task = asyncio.ensure_future(one(req, book.views(req)))
                    task.add_done_callback(note)
                    tasks.append(task)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            await gather_or_cancel(tasks)
        self._run(run)

    async def _read_range(self, name: str, start: int, views: list[memoryview]) -> None:
        end = start + sum(len(v) for v in views)

        async def get_range(client: Any, _: int) -> None:
            try:
                resp = await client.get_object(Bucket=self.bucket, Key=self.key(name),
                                               Range=f"bytes={start}-{end - 1}",
                                               **self.fs.req_kw)
            except Exception as e:
                status, code = error_status(e)
                if status == 416 or code == "InvalidRange":  # the object ends before `start`
                    raise EOFError(f"{self.location(name)}: object ends before byte {start}, "
                                   f"needed up to {end}") from None
                raise
            async with resp["Body"] as body:
                filled = await _read_into(body, views)
            if filled < end - start:
                raise EOFError(f"{self.location(name)}: object ends at byte {start + filled}, "
                               f"before {end}")
        await self._request(f"GET {self.location(name)} bytes {start}..{end}", get_range)

    # -- housekeeping -----------------------------------------------------------------------

    def list(self) -> list[str]:
        async def run() -> list[str]:
            names: list[str] = []
            prefix = f"{self.prefix}/" if self.prefix else ""
            token: dict[str, str] = {}
            while True:
                resp = await self._call(f"LIST {self.url}", "list_objects_v2", Prefix=prefix,
                                        Delimiter="/", **token, **self.fs.req_kw)
                names += [o["Key"][len(prefix):] for o in resp.get("Contents", [])]
                if not resp.get("IsTruncated"):
                    return names
                token = {"ContinuationToken": resp["NextContinuationToken"]}
        return self._run(run)

    def delete(self, names: Sequence[str]) -> None:
        async def run() -> None:
            await gather_or_cancel([
                self._call(f"DELETE {self.location(n)}", "delete_object", Key=self.key(n),
                           **self.fs.req_kw) for n in names])
        self._run(run)

    def close(self) -> None:
        self._sem = None
