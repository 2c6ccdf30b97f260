"""Which file-system errors (mounted NFS, ``nfs-rs``) are worth a retry."""

from __future__ import annotations

import errno

from dcp_plus.storage.retry import ErrorKinds, Verdict

RETRY_ERRNOS = frozenset({
    errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
    errno.ECONNREFUSED, errno.ENOTCONN, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EPIPE,
    errno.EAGAIN,
})
# nfs-rs protocol status names (NFS4ERR_*/NFS3ERR_*) that a retry can cure
_RETRY_STATUS = ("STALE", "_IO", "DELAY", "GRACE", "JUKEBOX", "EXPIRED", "BADSESSION",
                 "DEADSESSION", "SEQ_MISORDERED")


def is_nfs_retryable(exc: BaseException) -> bool:
    """True for errors a retry can cure: ESTALE, EIO, timeouts, lost connections, NFS DELAY."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in RETRY_ERRNOS:
        return True
    action = getattr(exc, "recovery_action", None)
    if action is not None and str(getattr(action, "value", action)) in ("retry", "reopen"):
        return True
    status = getattr(exc, "code_name", None)
    return isinstance(status, str) and any(s in status.upper() for s in _RETRY_STATUS)


def describe(exc: BaseException) -> str:
    """``Type (ERRNO, NFS status): message``."""
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
    status = getattr(exc, "code_name", None)
    tag = ", ".join(x for x in (name, status if isinstance(status, str) else "") if x)
    return f"{type(exc).__name__}{f' ({tag})' if tag else ''}: {exc}"


NFS_ERRORS = ErrorKinds(
    classify=lambda exc: Verdict.RETRY if is_nfs_retryable(exc) else Verdict.RAISE,
    describe=describe,
    hint="; the shared file system kept failing (stale handles, I/O errors or a lost "
         "server): check the server and the mount, or raise max_retries",
)
