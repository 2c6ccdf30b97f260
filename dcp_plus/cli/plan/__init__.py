"""Capacity and checkpoint-policy planning (``dcp-plus plan``): pure arithmetic, no torch."""

from dcp_plus.cli.plan.model import (
    CapacityInputError,
    CapacityInputs,
    CapacityPlan,
    ModePlan,
    checkfreq_exposed_s,
    checkfreq_interval_steps,
    plan_capacity,
    young_daly_interval_s,
)
from dcp_plus.cli.plan.report import render_text
from dcp_plus.cli.plan.units import parse_count, parse_duration, parse_fraction

__all__ = [
    "CapacityInputError",
    "CapacityInputs",
    "CapacityPlan",
    "ModePlan",
    "checkfreq_exposed_s",
    "checkfreq_interval_steps",
    "parse_count",
    "parse_duration",
    "parse_fraction",
    "plan_capacity",
    "render_text",
    "young_daly_interval_s",
]
