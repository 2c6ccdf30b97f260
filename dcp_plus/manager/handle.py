"""``SaveHandle``: what ``CheckpointManager.save`` returns."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from dcp_plus.errors import CheckpointSaveError
from dcp_plus.schedule.stats import SaveStats

_HINTS = {
    errno.ENOSPC: "the file system is full: free space, lower keep_last, or save elsewhere",
    errno.EDQUOT: "the disk quota is exhausted: free space or lower keep_last",
    errno.EACCES: "permission denied: make the checkpoint root writable by this user",
    errno.EPERM: "operation not permitted: make the checkpoint root writable by this user",
    errno.EROFS: "the file system is read-only: save to a writable location",
}
_MESSAGES = {code: f"[Errno {code}]" for code in _HINTS}


@dataclass
class SaveHandle:
    """One checkpoint in flight.

    Attributes:
        step: the training step saved.
        path: where it is written.
        staged: resolves (to ``None``) when the snapshot is complete; from then on the live
            state may change.
        done: resolves to the :class:`~dcp_plus.schedule.SaveStats` once the checkpoint is
            committed, ``latest`` advanced and retention run; or raises
            :class:`~dcp_plus.errors.CheckpointSaveError` (older checkpoints are untouched).
        blocking_s: how long ``save()`` held the calling thread.
        waited_s: of which, waiting for the previous persist.
        exposed_staging_s: how long the guarded ``optimizer.step()`` waited for the snapshot.
    """

    step: int
    path: str
    staged: Future[None] = field(default_factory=Future)
    done: Future[SaveStats] = field(default_factory=Future)
    blocking_s: float = 0.0
    waited_s: float = 0.0
    exposed_staging_s: float = 0.0
    started_at: float = 0.0
    staged_at: float | None = None
    device_copy_s: float | None = None

    def result(self, timeout: float | None = None) -> SaveStats:
        """Wait for the commit; raises ``CheckpointSaveError`` if the save failed."""
        return self.done.result(timeout)

    def committed(self) -> bool:
        """Whether the save has ended and committed (no wait)."""
        return self.done.done() and self.done.exception() is None

    def stats(self, ok: bool, done_at: float) -> SaveStats:
        staged_at = self.staged_at if self.staged_at is not None else done_at
        return SaveStats(step=self.step, blocking_s=self.blocking_s, waited_s=self.waited_s,
                         exposed_staging_s=self.exposed_staging_s,
                         staging_s=max(0.0, staged_at - self.started_at),
                         persist_s=max(0.0, done_at - staged_at), ok=ok,
                         device_copy_s=self.device_copy_s)


def rank_causes(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """(rank, exception) pairs inside DCP's ``CheckpointException`` (or the exception)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        out = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            out.append((rank, inner if isinstance(inner, BaseException) else exc))
        return out
    return [(None, exc)]


def save_error(step: int, path: str, exc: BaseException, what: str) -> CheckpointSaveError:
    """A ``CheckpointSaveError`` naming step, path, failing rank(s), cause and the fix."""
    parts = []
    hints: list[str] = []
    for rank, cause in rank_causes(exc):
        text = f"{type(cause).__name__}: {cause}".strip()
        parts.append(text if rank is None else f"rank {rank}: {text}")
        code = getattr(cause, "errno", None)
        for c, hint in _HINTS.items():
            if (code == c or _MESSAGES[c] in text) and hint not in hints:
                hints.append(hint)
    msg = (f"checkpoint of step {step} at {path} failed while {what}: {'; '.join(parts)}. "
           "Older checkpoints are untouched and training can go on")
    if hints:
        msg += f" ({'; '.join(hints)})"
    err = CheckpointSaveError(msg)
    err.__cause__ = _detached(exc)
    return err


def wrapped_errors(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it wraps (causes, contexts, DCP's per-rank failures),
    each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        todo.extend(inner for _, inner in rank_causes(e) if inner is not e)


def _detached(exc: BaseException) -> BaseException:
    """Drop the tracebacks of ``exc`` and of what it wraps: their frames hold the staged
    state dict, and a handle kept by the caller would keep the stager's buffer forever."""
    for e in wrapped_errors(exc):
        e.__traceback__ = None
    return exc
