"""Bounded retries with exponential backoff and full jitter for remote storage requests.

Retried: throttling (429, ``SlowDown``...), server errors (5xx) and transport failures
(connection refused/reset, timeouts, truncated responses). Everything else (403, 404, bad
requests) fails at once. botocore and aiohttp are imported only if installed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from dcp_plus.errors import StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestThrottled", "ServiceUnavailable", "InternalError", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete", "503", "500", "502", "504",
})


def _transport_errors() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    try:
        from botocore import exceptions as be

        kinds += [getattr(be, n) for n in ("HTTPClientError", "ConnectionError",
                                           "IncompleteReadError", "ResponseStreamingError")
                  if hasattr(be, n)]
    except ImportError:
        pass
    try:
        import aiohttp

        kinds += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    return tuple(kinds)


_TRANSPORT: tuple[type[BaseException], ...] | None = None


def error_status(exc: BaseException) -> tuple[int | None, str | None]:
    """HTTP status and S3 error code of a botocore ``ClientError``-like exception."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return (status if isinstance(status, int) else None), (str(code) if code else None)


def is_retryable(exc: BaseException) -> bool:
    """True for throttling, 5xx and transport errors; False for everything else."""
    global _TRANSPORT
    if _TRANSPORT is None:
        _TRANSPORT = _transport_errors()
    status, code = error_status(exc)
    if status is not None or code is not None:
        return (status is not None and (status >= 500 or status == 429)) or (
            code in THROTTLE_CODES)
    return isinstance(exc, _TRANSPORT)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one request.

    Attributes:
        max_retries: retries after the first attempt (0: no retry).
        base_delay: backoff before retry ``n`` is uniform in ``[0, base_delay * 2**n]``...
        max_delay: ...capped at ``max_delay`` seconds.
    """

    max_retries: int = 5
    base_delay: float = 0.2
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"RetryPolicy values must be >= 0, got {self}")

    def delay(self, attempt: int) -> float:
        """Full-jitter backoff before retry number ``attempt`` (0-based)."""
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))

    def give_up(self, what: str, exc: BaseException, attempts: int) -> StorageError:
        status, code = error_status(exc)
        detail = f" (HTTP {status} {code})" if status or code else ""
        hint = ("; the store kept failing (throttling, server errors or connection failures): "
                "check that the endpoint is up and reachable, or raise max_retries"
                if is_retryable(exc) else "")
        err = StorageError(f"{what} failed after {attempts} attempt(s){detail}: "
                           f"{type(exc).__name__}: {exc}{hint}")
        return err


async def retry_async(fn: Callable[[int], Awaitable[T]], policy: RetryPolicy, what: str) -> T:
    """Await ``fn(attempt)`` until it succeeds, a non-retryable error occurs, or retries run out.

    Raises:
        StorageError: naming ``what``, the attempts made and the last error, for a request
            that failed with an HTTP error or kept failing; other exceptions pass unchanged.
    """
    attempt = 0
    while True:
        try:
            return await fn(attempt)
        except Exception as e:
            if not is_retryable(e) and error_status(e) == (None, None):
                raise  # not a failed request (e.g. EOFError, FileNotFoundError): as it is
            if not is_retryable(e) or attempt >= policy.max_retries:
                raise policy.give_up(what, e, attempt + 1) from e
            delay = policy.delay(attempt)
            log.info("%s: %s: %s; retry %d/%d in %.2fs", what, type(e).__name__, e,
                     attempt + 1, policy.max_retries, delay)
            await asyncio.sleep(delay)
            attempt += 1


def retry_sync(fn: Callable[[int], T], policy: RetryPolicy, what: str) -> T:
    """The blocking form of :func:`retry_async`."""
    attempt = 0
    while True:
        try:
            return fn(attempt)
        except Exception as e:
            if not is_retryable(e) and error_status(e) == (None, None):
                raise  # not a failed request (e.g. EOFError, FileNotFoundError): as it is
            if not is_retryable(e) or attempt >= policy.max_retries:
                raise policy.give_up(what, e, attempt + 1) from e
            delay = policy.delay(attempt)
            log.info("%s: %s: %s; retry %d/%d in %.2fs", what, type(e).__name__, e,
                     attempt + 1, policy.max_retries, delay)
            time.sleep(delay)
            attempt += 1
