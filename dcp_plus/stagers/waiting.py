"""How a stager waits for snapshots to be released: with one ``gc.collect()`` and warnings."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

GC_AFTER_S = 1.0
"""Waiting this long for a buffer runs one ``gc.collect()`` (a cycle may hold a staged dict)."""
WARN_EVERY_S = 60.0


def wait_until(
    cond: threading.Condition,
    pred: Callable[[], bool],
    timeout: float | None,
    held: Callable[[], int],
    after_gc: Callable[[], None] | None = None,
) -> bool:
    """Wait on ``cond`` until ``pred()``; False if ``timeout`` seconds passed first.

    After :data:`GC_AFTER_S` runs one ``gc.collect()`` and then ``after_gc``; every
    :data:`WARN_EVERY_S` logs a warning naming ``held()`` staged dicts still alive.
    """
    start = time.monotonic()
    collected = False
    next_warn = WARN_EVERY_S
    with cond:
        while not pred():
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                return False
            if waited >= GC_AFTER_S and not collected:
                collected = True
                gc.collect()
                if after_gc is not None:
                    after_gc()
                continue
            if waited >= next_warn:
                next_warn += WARN_EVERY_S
                logger.warning(
                    "ArenaStager: waited %.0fs for %d staged dict(s) to be released; a "
                    "reference outlives its save (see docs/stager.md, 'buffer release')",
                    waited,
                    held(),
                )
            step = GC_AFTER_S if not collected else 5.0
            if timeout is not None:
                step = min(step, timeout - waited)
            cond.wait(max(step, 0.001))
    return True
