"""URL helpers shared by every layer."""

from __future__ import annotations

import os


def is_url(path: str | os.PathLike) -> bool:
    return "://" in str(path)
