"""Checkpoint interval policies and overhead accounting (see ``docs/manager.md``)."""

from dcp_plus.schedule.policies import (
    AdaptiveInterval,
    DalyInterval,
    Decision,
    EveryN,
    IntervalPolicy,
)
from dcp_plus.schedule.stats import OverheadMeter, SaveStats

__all__ = ["AdaptiveInterval", "DalyInterval", "Decision", "EveryN", "IntervalPolicy",
           "OverheadMeter", "SaveStats"]
