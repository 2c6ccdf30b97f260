"""Which failed requests to HTTP object stores (S3, fsspec filesystems) are worth a retry.

Retried: throttling (429, ``SlowDown``...), server errors (5xx) and transport failures
(connection refused/reset, timeouts, truncated responses). Other HTTP errors (403, 404, bad
requests) fail at once; errors that are no failed request pass unchanged. botocore and
aiohttp are imported only if installed.
"""

from __future__ import annotations

import asyncio

from dcp_plus.storage.retry import ErrorKinds, Verdict

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


def _classify(exc: BaseException) -> Verdict:
    if is_retryable(exc):
        return Verdict.RETRY
    return Verdict.RAISE if error_status(exc) == (None, None) else Verdict.FAIL


def _detail(exc: BaseException) -> str:
    status, code = error_status(exc)
    return f" (HTTP {status} {code})" if status or code else ""


HTTP_ERRORS = ErrorKinds(
    classify=_classify,
    describe=lambda exc: f"{type(exc).__name__}: {exc}",
    hint="; the store kept failing (throttling, server errors or connection failures): "
         "check that the endpoint is up and reachable, or raise max_retries",
    detail=_detail,
)

