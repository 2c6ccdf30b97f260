"""The adaptive checkpoint interval (``checkpoint.adaptive_budget``) of
``DcpPlusCheckpointManager``: a mixin placed before TorchTitan's ``CheckpointManager``, whose
``_should_save`` it answers when the budget is set."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from dcp_plus.integrations._titan_schedule import LoopSchedule
from dcp_plus.manager.control import ControlGroup
from dcp_plus.schedule import AdaptiveInterval

log = logging.getLogger(__name__)


class AdaptiveSaves:
    """Rank 0 runs an :class:`~dcp_plus.schedule.AdaptiveInterval` fed by a
    :class:`LoopSchedule`; every rank saves when it says so."""

    dcpp: Any
    saves: list[Any]
    enable: bool
    load_only: bool
    enable_first_step_checkpoint: bool
    interval: int
    _schedule: LoopSchedule | None
    _ctl: ControlGroup | None

    def _init_adaptive(self, budget: float, warmup: int) -> None:
        """Rank 0 runs the policy; every step it broadcasts its answer on ``_ctl`` (the
        manager's gloo group for decisions; None for a single process)."""
        if self._ctl is None or dist.get_rank() == 0:
            self._schedule = LoopSchedule(AdaptiveInterval(budget, warmup=warmup))
        log.info("dcp_plus: checkpoint steps chosen by AdaptiveInterval(p=%g, warmup=%d) on "
                 "rank 0 (checkpoint.interval=%d is not used)", budget, warmup, self.interval)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.dcpp.adaptive_budget is None:
            return super()._should_save(curr_step, last_step)  # type: ignore[misc]
        if not self.enable or self.load_only:
            return False
        if self._schedule is not None:
            self._schedule.tick(curr_step)
        if last_step or (curr_step == 1 and self.enable_first_step_checkpoint):
            return True  # TorchTitan's forced saves; the same on every rank
        return self._adaptive_decision(curr_step)

    def _adaptive_decision(self, step: int) -> bool:
        """Rank 0's policy answer for ``step``, the same on every rank."""
        want = self._schedule.decide(step) if self._schedule is not None else False
        return want if self._ctl is None else self._ctl.rank0_decides(want)

    def _report(self, step: int, waited_s: float, staged: Future | None,
                done: Future | None) -> None:
        """Tell the adaptive schedule (rank 0) what this save cost the loop (``staged``,
        ``done``: its futures, None for a synchronous save)."""
        if self._schedule is None:
            return
        self._schedule.saved(step, blocking_s=waited_s + self.saves[-1].blocking_s,
                             waited_s=waited_s, staged=staged, done=done)
