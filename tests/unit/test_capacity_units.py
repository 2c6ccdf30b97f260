"""Friendly inputs of the planner: 405B parameters, 3h, 5%."""

from __future__ import annotations

import pytest

from dcp_plus.cli.plan.units import (
    human_bytes,
    human_count,
    human_duration,
    parse_count,
    parse_duration,
    parse_fraction,
)


@pytest.mark.parametrize("text,value", [
    ("405B", 405e9), ("405b", 405e9), ("405e9", 405e9), ("1.5T", 1.5e12), ("70_000_000", 7e7),
    ("125M", 125e6), ("8k", 8e3), (" 7G ", 7e9), ("12", 12.0),
])
def test_counts_accept_suffixes_and_scientific_notation(text, value):
    assert parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["405X", "-1", "0", "B", "", "1e", "nan"])
def test_bad_counts_are_refused_with_an_example(text):
    with pytest.raises(ValueError, match="405B|positive"):
        parse_count(text)


@pytest.mark.parametrize("text,unit_s,seconds", [
    ("3h", 1.0, 10800.0), ("90min", 1.0, 5400.0), ("2.5d", 1.0, 216000.0), ("4.2s", 1.0, 4.2),
    ("800ms", 1.0, 0.8), ("3", 3600.0, 10800.0), ("1.5", 1.0, 1.5), ("30 min", 3600.0, 1800.0),
])
def test_durations_take_units_or_the_flags_default_unit(text, unit_s, seconds):
    assert parse_duration(text, unit_s=unit_s) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["3 weeks", "h", "-2h", "0s"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_fractions_take_percent_or_decimal_and_must_be_inside_the_unit_interval():
    assert parse_fraction("5%") == pytest.approx(0.05)
    assert parse_fraction("0.05") == pytest.approx(0.05)
    assert parse_fraction("0", closed=True) == 0.0 and parse_fraction("100%", closed=True) == 1.0
    for bad in ("0", "150%", "abc", "1"):
        with pytest.raises(ValueError):
            parse_fraction(bad)


def test_human_units_are_decimal():
    assert human_bytes(4.05e12) == "4.05 TB"
    assert human_bytes(506.25e9) == "506.2 GB"
    assert human_count(405e9) == "405B"
    assert [human_duration(s) for s in (0.25, 42.0, 810.0, 10800.0, 3 * 86400.0)] == [
        "250 ms", "42.0 s", "13.5 min", "3.0 h", "3.0 d"]
