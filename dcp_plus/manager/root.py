"""``CheckpointRoot``: the step folders and the ``latest`` pointer under one root.

Listing, the pointer, clean-up of unfinished saves and retention. The manager decides when
(only the lease holder changes a root); this module only knows how.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from dcp_plus.errors import DcpPlusError
from dcp_plus.format.record import RECORD_NAME, record_bases
from dcp_plus.manager.naming import (
    POINTER_NAME,
    decode_pointer,
    encode_pointer,
    parse_step,
    step_dirname,
)
from dcp_plus.manager.retention import to_remove
from dcp_plus.manager.storage import Backend

log = logging.getLogger(__name__)


class CheckpointRoot:
    """The checkpoints ``step_XXXXXXXX/`` under ``location``, through ``backend``."""

    def __init__(self, backend: Backend, location: str) -> None:
        self.backend = backend
        self.location = location

    def path(self, step: int) -> str:
        return self.backend.join(self.location, step_dirname(step))

    def scan(self) -> list[tuple[int, bool]]:
        """``(step, committed)`` for every step folder, in listing order."""
        out = []
        for name in self.backend.listdir(self.location):
            step = parse_step(name)
            if step is not None:
                out.append((step, self.backend.is_committed(self.path(step))))
        return out

    def committed(self) -> list[int]:
        """The committed steps, in listing order."""
        return [s for s, committed in self.scan() if committed]

    def latest_step(self) -> int | None:
        """The step the ``latest`` pointer names (advanced only after a commit)."""
        data = self.backend.read(self.backend.join(self.location, POINTER_NAME))
        return None if data is None else decode_pointer(data)

    def write_pointer(self, step: int) -> None:
        """Point ``latest`` at ``step``; a failure is logged (resume scans for itself)."""
        try:
            self.backend.write_atomic(self.backend.join(self.location, POINTER_NAME),
                                      encode_pointer(step))
        except OSError as e:
            log.warning("checkpoint step %d is committed but the 'latest' pointer could not be "
                        "advanced: %s", step, e)

    def clean_uncommitted(self) -> list[str]:
        """Remove step folders without a commit record (left by a crash); returns them."""
        removed = []
        for step, committed in self.scan():
            if committed:
                continue
            path = self.path(step)
            try:
                self.backend.remove_tree(path)
            except OSError as e:
                log.warning("could not remove uncommitted checkpoint %s: %s", path, e)
                continue
            log.warning("removed uncommitted checkpoint %s (a save interrupted by a crash)", path)
            removed.append(path)
        for name in self.backend.listdir(self.location):
            if name.startswith(POINTER_NAME + ".") and name.endswith(".tmp"):
                try:
                    os.unlink(self.backend.join(self.location, name))
                except OSError:
                    pass
        return removed

    def repair_pointer(self) -> None:
        """Point ``latest`` at the newest committed step if it names another."""
        newest = max(self.committed(), default=None)
        if newest is not None and self.latest_step() != newest:
            log.warning("'latest' pointer said %s, newest committed is step %d: fixed",
                        self.latest_step(), newest)
            self.write_pointer(newest)

    def remove_failed(self, path: str, allowed: Callable[[], bool]) -> None:
        """Remove the folder of a save that failed, unless it committed after all or
        ``allowed()`` (asked last) says no."""
        try:
            if not self.backend.is_committed(path) and allowed():
                self.backend.remove_tree(path)
        except FileNotFoundError:
            pass
        except Exception as e:  # storage down as well: the next holder's start cleans up
            log.warning("could not remove the failed checkpoint %s: %s", path, e)

    def references(self, step: int) -> set[int] | None:
        """The steps checkpoint ``step`` references (incremental bases); None when its record
        cannot be read."""
        source = self.backend.join(self.path(step), RECORD_NAME)
        try:
            data = self.backend.read(source)
            names = [] if data is None else record_bases(data, source)
        except (DcpPlusError, OSError) as e:
            log.warning("retention keeps every checkpoint: the references of %s are unknown "
                        "(%s)", source, e)
            return None
        return {s for s in map(parse_step, names) if s is not None}

    def retain(self, keep_last: int | None, keep_every: int | None,
               uncommitted: Callable[[int], None]) -> None:
        """Delete what retention drops: commit record first (``uncommitted(step)`` is
        called then), then the folder; newest first, so that a crash half-way never leaves a
        committed incremental checkpoint whose base is gone (bases are older saves)."""
        for step in reversed(to_remove(self.committed(), keep_last, keep_every,
                                       self.references)):
            path = self.path(step)
            try:
                self.backend.uncommit(path)
                uncommitted(step)
                self.backend.remove_tree(path)
                log.info("retention removed checkpoint step %d (%s)", step, path)
            except OSError as e:
                log.warning("retention could not remove %s: %s", path, e)
