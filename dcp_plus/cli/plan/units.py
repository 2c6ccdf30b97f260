"""Friendly quantities for the planner's inputs: ``405B`` parameters, ``3h``, ``5%``.

Decimal units throughout (1 GB = 10^9 bytes, as storage and link vendors count).
"""

from __future__ import annotations

import math
import re

_COUNT_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_DURATION_S = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
               "hr": 3600.0, "d": 86400.0, "day": 86400.0, "days": 86400.0}
_NUMBER = r"([0-9][0-9_]*\.?[0-9]*(?:e[+-]?[0-9]+)?|\.[0-9]+(?:e[+-]?[0-9]+)?)"


def _finite_positive(value: float, text: str, what: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {text!r}")
    return value


def parse_count(text: str | float) -> float:
    """``"405B"``, ``"405e9"``, ``"1.5T"``, ``"70_000_000"`` -> a count.

    Suffixes (case-insensitive): k = 10^3, M = 10^6, B or G = 10^9, T = 10^12.

    Raises:
        ValueError: not a positive number with an optional suffix.
    """
    if isinstance(text, (int, float)):
        return _finite_positive(float(text), str(text), "a count")
    m = re.fullmatch(_NUMBER + r"\s*([kmbgt]?)", text.strip().lower())
    if not m:
        raise ValueError(f"not a count: {text!r} (try 405B, 405e9 or 1.5T)")
    return _finite_positive(float(m[1].replace("_", "")) * _COUNT_SUFFIX[m[2]], text, "a count")


def parse_duration(text: str | float, *, unit_s: float = 1.0) -> float:
    """``"3h"``, ``"90min"``, ``"2.5d"``, ``"4.2s"``, ``"800ms"`` -> seconds; a bare number is
    in units of ``unit_s`` seconds (``parse_duration("3", unit_s=3600) == 10800``).

    Raises:
        ValueError: not a positive number with an optional unit (s, min, h, d).
    """
    if isinstance(text, (int, float)):
        return _finite_positive(float(text) * unit_s, str(text), "a duration")
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
    if not m or (m[2] and m[2] not in _DURATION_S):
        raise ValueError(f"not a duration: {text!r} (try 800ms, 4.2s, 90min, 3h or 2d)")
    scale = _DURATION_S[m[2]] if m[2] else unit_s
    return _finite_positive(float(m[1].replace("_", "")) * scale, text, "a duration")


def parse_fraction(text: str | float, *, closed: bool = False) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05; must lie in (0, 1), or in [0, 1] if ``closed``.

    Raises:
        ValueError: not a number, or out of range.
    """
    if isinstance(text, (int, float)):
        value, shown = float(text), str(text)
    else:
        shown = text.strip()
        try:
            value = float(shown[:-1]) / 100 if shown.endswith("%") else float(shown)
        except ValueError:
            raise ValueError(f"not a fraction: {text!r} (try 5% or 0.05)") from None
    if not (0 <= value <= 1 if closed else 0 < value < 1):
        bounds = "0 and 1" if closed else "0 and 1 (exclusive)"
        raise ValueError(f"a fraction must lie between {bounds}, got {shown!r}")
    return value


def human_count(n: float) -> str:
    """``405B``, ``1.5T``, ``70M``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.4g}"


def human_bytes(n: float) -> str:
    """Decimal units: ``4.05 TB``, ``506.2 GB``."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if n / scale < 10 else 1}f} {unit}"
    return f"{n:.0f} B"


def human_duration(seconds: float) -> str:
    """``13.5 min``, ``42.0 s``, ``3.0 h``, ``2.1 d``, ``850 ms``."""
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    for unit, scale in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= scale * (2 if unit == "d" else 1):
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} s"
