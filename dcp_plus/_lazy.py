"""Lazy package exports: a package names its public objects without importing them.

Writer worker processes import ``dcp_plus.writers.worker``, which imports its parent packages;
those must not pull in torch, so they resolve their names on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                                   Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose name ``n`` lives in module
    ``exports[n]`` (absolute, or relative to ``package`` when it starts with a dot)."""
    names = sorted(exports)

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    def dir_() -> list[str]:
        return names

    return getattr_, dir_
