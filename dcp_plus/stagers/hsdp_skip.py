"""The HSDP staging skip of one :class:`~dcp_plus.stagers.ArenaStager` (``skip_unwritten``).

With HSDP another replica writes some of this rank's tensors; a snapshot need not copy them.
The stager asks the planner its snapshots are saved with (:class:`WriteSetSource`) which
tensors its last save on this rank did not write, leaves those views stale and records them
in :data:`~dcp_plus.memory.skipped.stale_views`, where the planner's ``finish_plan`` fails a
save that would write one (see ``docs/stager.md``, "HSDP staging skip").

The skip works only where the planner runs in this process: DCP's THREAD executor. With the
PROCESS executor the staged dict is pickled into DCP's daemon; the stager learns that from
its ``executor`` argument or, by default, from the first staged dict that is pickled, and
copies every tensor from then on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch

from dcp_plus.memory.skipped import StaleEntry
from dcp_plus.stagers.arena import Extent

logger = logging.getLogger(__name__)

ExecutorKind = Literal["thread", "process", "other"]
"""Who consumes a staged dict (see ``ArenaStager(executor=...)``)."""
EXECUTOR_KINDS: tuple[ExecutorKind, ...] = ("thread", "process", "other")

_EMPTY: frozenset[str] = frozenset()


class WriteSetSource(Protocol):
    """What ``skip_unwritten`` needs: a ``CachedSavePlanner`` (see ``docs/planner.md``)."""

    def unwritten_tensor_fqns(self, fqns: Sequence[str]) -> frozenset[str]: ...


class SkipControl:
    """Whether, and which tensors, the snapshots of one stager skip.

    ``lock`` is the stager's lock; the stager calls :meth:`released` and :meth:`reclaimed`
    holding it, every other method takes it.
    """

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._planner: WriteSetSource | None = None
        self.off: str | None = None
        """Why skipping stopped for good (until :meth:`bind` re-arms it), or None."""
        self._pause = False  # the last checked save failed: copy all in the next snapshot
        self._pickled = False  # a staged dict crossed into another process
        self._warned_process = False

    def bind(self, planner: WriteSetSource | None) -> None:
        """Skip what ``planner``'s last save did not write; ``None`` turns skipping off."""
        if planner is not None and not callable(getattr(planner, "unwritten_tensor_fqns", None)):
            raise TypeError(
                "skip_unwritten needs a CachedSavePlanner (an object with "
                f"unwritten_tensor_fqns()), got {type(planner).__name__}"
            )
        with self._lock:
            self._planner = planner
            self.off = None
            self._pause = False

    def armed(self, executor: ExecutorKind) -> bool:
        """``stage()``: may this snapshot skip tensors (asked before it is copied)?"""
        with self._lock:
            if self._planner is None or self.off is not None:
                return False
            if executor != "process" and not self._pickled:
                return True
            if not self._warned_process:
                self._warned_process = True
                logger.warning(
                    "ArenaStager(skip_unwritten=...) is ignored with DCP's PROCESS executor "
                    "(the planner runs in its daemon): every tensor is copied"
                )
            return False

    def query(self, fqns: list[str]) -> frozenset[str]:
        """Driver thread: the fqns this snapshot may leave out (empty: copy everything)."""
        with self._lock:
            planner, off = self._planner, self.off
            if self._pause:
                self._pause = False
                return _EMPTY
        if planner is None or off is not None:
            return _EMPTY
        try:
            return planner.unwritten_tensor_fqns(fqns)
        except Exception:
            logger.exception("ArenaStager: skip_unwritten query failed; copying every tensor")
            return _EMPTY

    def pickled(self) -> None:
        """A staged dict is being pickled (DCP's PROCESS executor): never skip again."""
        with self._lock:
            self._pickled = True

    def reclaimed(self, entry: StaleEntry | None) -> None:
        """A snapshot's buffer was reused before its save vouched for its skipped views."""
        if entry is not None:
            self._pause = True

    def released(self, entry: StaleEntry | None) -> None:
        """A snapshot with skipped views (``entry``) was released: did its save check them?"""
        if entry is None:
            return
        if entry.failed:
            self._pause = True
        elif not entry.checked:
            self.off = (
                f"a snapshot with {len(entry.views)} skipped tensor(s) was released "
                "without a CachedSavePlanner checking its save plan: its save failed "
                "before planning finished, or it was saved with another planner (which "
                "would have written the skipped tensors' stale bytes)"
            )
            logger.error(
                "ArenaStager(skip_unwritten=...): %s; skipping is off for this stager "
                "(call skip_unwritten_by() to re-arm it)",
                self.off,
            )


def split_copies(
    fqns: list[str],
    sources: list[torch.Tensor],
    views: list[torch.Tensor],
    extents: Sequence[Extent],
    skip: frozenset[str],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[int, str], int]:
    """The ``(source, view)`` pairs to copy, the stale views ``{data_ptr: fqn}`` left out,
    and the tensor bytes skipped."""
    if not skip:
        return list(zip(sources, views, strict=True)), {}, 0
    copy: list[tuple[torch.Tensor, torch.Tensor]] = []
    stale: dict[int, str] = {}
    skipped = 0
    for i, f in enumerate(fqns):
        if f in skip:
            nbytes = extents[i].nbytes
            if nbytes:
                stale[views[i].data_ptr()] = f
                skipped += nbytes
        else:
            copy.append((sources[i], views[i]))
    return copy, stale, skipped


def check_executor(executor: Any) -> ExecutorKind:
    """``executor`` if it is an :data:`ExecutorKind`, else a ``ValueError`` naming the choices."""
    if executor not in EXECUTOR_KINDS:
        raise ValueError(
            f"ArenaStager(executor=...) must be one of {', '.join(map(repr, EXECUTOR_KINDS))}, "
            f"got {executor!r}"
        )
    return executor  # type: ignore[no-any-return]
