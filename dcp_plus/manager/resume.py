"""Resume: the newest checkpoint that every rank of the job can verify and load."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from dcp_plus.manager.control import ControlGroup, quiet_if_alone
from dcp_plus.manager.root import CheckpointRoot
from dcp_plus.planners import SafeLoadPlanner

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
