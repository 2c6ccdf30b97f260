"""Resume: the newest checkpoint that every rank of the job can verify and load, from the
fastest tier that has it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus.manager.control import ControlGroup, quiet_if_alone
from dcp_plus.manager.root import CheckpointRoot
from dcp_plus.planners import SafeLoadPlanner
from dcp_plus.stagers import ArenaStager
from dcp_plus.tiers import Restore, TierOptions, Tiers
from dcp_plus.tiers.recovery import DURABLE

log = logging.getLogger(__name__)


def load_newest(root: CheckpointRoot, state: dict[str, Any], *,
                reader: Callable[[str], StorageReader], verify: bool,
                ctl: ControlGroup | None, group: Any, rank: int) -> int | None:
    """Load, in place, the newest checkpoint committed, verified (``verify``) and loadable on
    every rank of ``ctl``; returns its step, or None.

    The candidates are the union of every rank's committed steps, newest first; one is taken
    only if every rank verified it, and skipped if loading it fails anywhere (``state`` is
    then overwritten by the next candidate).
    """
    local = root.committed()
    candidates = set(local) if ctl is None else {s for steps in ctl.gather(local) for s in steps}
    for step in sorted(candidates, reverse=True):
        path = root.path(step)
        if step not in local or not root.backend.is_committed(path):
            problems = [f"{path}: not committed here"]
        else:
            problems = root.backend.verify(path) if verify else []
        if problems:
            log.warning("rank %d cannot load step %d: %s", rank, step, "; ".join(problems[:3]))
        ok = not problems if ctl is None else ctl.everyone(not problems)
        if not ok:
            log.warning("skipping step %d: not every rank can load it", step)
            continue
        try:
            with quiet_if_alone(ctl is None):
                dcp.load(state, storage_reader=reader(path), planner=SafeLoadPlanner(),
                         process_group=group, no_dist=ctl is None)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException; it is
            # raised on every rank when any rank failed
            log.warning("loading step %d from %s failed, trying an older one: %s",
                        step, path, e)
            continue
        log.info("resumed from step %d (%s)", step, path)
        return step
    return None


def tiers_for(options: TierOptions, root: str, rank: int, world_size: int, stager: Any,
              ranks: list[int] | None) -> Tiers | None:
    """The manager's tiers (None without a memory tier, or for a reader: ``stager`` None)."""
    if not options.memory_tier or stager is None:
        return None
    if not isinstance(stager, ArenaStager) or stager.buffers != 2:
        raise ValueError("memory_tier=True needs an ArenaStager(buffers=2) (the default "
                         "stager): the newest snapshot stays in one buffer while the next "
                         "is taken into the other")
    stager.skip_unwritten_by(None)  # a kept snapshot must be whole
    stager.executor = "other"  # only the tier says when a kept snapshot's buffer is free
    return Tiers(options, root, rank, world_size, ranks)


def restore_from_tiers(tiers: Tiers, state: dict[str, Any], durable: list[int], *,
                       path: Callable[[int], str], reader: Callable[[str], StorageReader],
                       ctl: ControlGroup | None) -> Restore | None:
    """The ranks agree (on ``ctl``) on the newest step every rank can restore from its own
    memory, its partner's replica or the ``durable`` steps (this rank's committed ones,
    ``path(step)`` their checkpoints), and restore ``state`` in place from the fastest tier.

    Returns what was chosen, or None when no rank holds a snapshot (``state`` is then not
    touched: a ``Stateful``'s ``state_dict()`` may change it, e.g. torch initializes an
    optimizer's state) or no step qualifies. An all-durable choice is not loaded here: the
    caller loads it its usual way (collective, verified), as it does on None.
    """
    held = tiers.holds_snapshots()
    if not (held if ctl is None else not ctl.everyone(not held)):
        return None

    def load_durable(step: int, plain_state: dict[str, Any]) -> None:
        dcp.load(plain_state, storage_reader=reader(path(step)), planner=SafeLoadPlanner(),
                 no_dist=True)

    return tiers.restore(state, durable, load_durable,
                         gather=ctl.gather if ctl is not None else lambda offer: [offer],
                         everyone=ctl.everyone if ctl is not None else lambda ok: ok)


def load_fastest(tiers: Tiers | None, root: CheckpointRoot, state: dict[str, Any], *,
                 reader: Callable[[str], StorageReader], verify: bool,
                 ctl: ControlGroup | None, group: Any, rank: int, world_size: int,
                 clock: Callable[[], float] = time.perf_counter) -> Restore | None:
    """Restore ``state`` from the fastest tier holding the newest step every rank can
    restore (durable storage alone without ``tiers``); None when there is none."""
    t0 = clock()
    if tiers is not None:
        done = restore_from_tiers(tiers, state, root.committed(), path=root.path,
                                  reader=reader, ctl=ctl)
        if done is not None and any(t != DURABLE for t in done.tiers):
            log.info("restored step %d from %s in %.2f s", done.step, done.tiers, done.seconds)
            return done
    step = load_newest(root, state, reader=reader, verify=verify, ctl=ctl, group=group,
                       rank=rank)
    return None if step is None else Restore(step, [DURABLE] * world_size, clock() - t0)
