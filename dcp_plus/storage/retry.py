"""One bounded retry loop, with exponential backoff and full jitter, for every store.

Which errors are worth a retry depends on the store: each supplies an :class:`ErrorKinds`
(HTTP stores: :data:`~dcp_plus.storage.http_errors.HTTP_ERRORS`, file systems:
:data:`~dcp_plus.storage.nfs_errors.NFS_ERRORS`). :class:`Retry` binds it to a
:class:`RetryPolicy` and runs blocking (:meth:`Retry.call`) or async (:meth:`Retry.acall`)
attempts with the same bookkeeping.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from dcp_plus.errors import StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Verdict(enum.Enum):
    """What a failed attempt's error means."""

    RETRY = "retry"  # transient: retried, then a StorageError once the retries are spent
    FAIL = "fail"  # a failed request no retry cures: a StorageError at once
    RAISE = "raise"  # not a failed request (EOFError, FileNotFoundError...): raised as it is


def _no_detail(exc: BaseException) -> str:
    return ""


@dataclass(frozen=True)
class ErrorKinds:
    """A store's reading of its errors.

    Attributes:
        classify: the :class:`Verdict` on an error.
        describe: the error in a log line or message, e.g. ``OSError (ESTALE): ...``.
        hint: appended to the final error when a retryable error persisted.
        detail: put right after "failed after N attempt(s)", e.g. `` (HTTP 503 SlowDown)``.
    """

    classify: Callable[[BaseException], Verdict]
    describe: Callable[[BaseException], str]
    hint: str
    detail: Callable[[BaseException], str] = _no_detail


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


@dataclass(frozen=True)
class Retry:
    """Attempts of one request, retried per ``policy`` while ``errors`` says so.

    ``fn(attempt)`` (``attempt`` counts from 0) runs until it returns or fails for good:
    a :attr:`Verdict.RAISE` error is raised as it is; a :attr:`Verdict.FAIL` error, or a
    :attr:`Verdict.RETRY` error after ``policy.max_retries`` retries, becomes a
    :class:`~dcp_plus.errors.StorageError` naming the request, the attempts and the error.
    """

    policy: RetryPolicy
    errors: ErrorKinds

    def call(self, fn: Callable[[int], T], what: str) -> T:
        """Run blocking attempts, sleeping between them."""
        attempt = 0
        while True:
            try:
                return fn(attempt)
            except Exception as e:
                time.sleep(self._backoff(what, e, attempt))
            attempt += 1

    async def acall(self, fn: Callable[[int], Awaitable[T]], what: str) -> T:
        """Await attempts, sleeping on the event loop between them."""
        attempt = 0
        while True:
            try:
                return await fn(attempt)
            except Exception as e:
                await asyncio.sleep(self._backoff(what, e, attempt))
            attempt += 1

    def _backoff(self, what: str, exc: Exception, attempt: int) -> float:
        """The delay before retrying after attempt ``attempt`` failed with ``exc``, or the
        error to raise instead."""
        verdict = self.errors.classify(exc)
        if verdict is Verdict.RAISE:
            raise exc
        if verdict is Verdict.FAIL or attempt >= self.policy.max_retries:
            hint = self.errors.hint if verdict is Verdict.RETRY else ""
            raise StorageError(
                f"{what} failed after {attempt + 1} attempt(s){self.errors.detail(exc)}: "
                f"{self.errors.describe(exc)}{hint}") from exc
        delay = self.policy.delay(attempt)
        log.info("%s: %s; retry %d/%d in %.2fs", what, self.errors.describe(exc), attempt + 1,
                 self.policy.max_retries, delay)
        return delay
