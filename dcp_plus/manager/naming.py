"""Names under a manager's root: ``step_00000120/`` per checkpoint and the ``latest`` pointer."""

from __future__ import annotations

import json
import re

STEP_PREFIX = "step_"
POINTER_NAME = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint steps are non-negative, got {step}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None for other names."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def encode_pointer(step: int) -> bytes:
    return json.dumps({"step": step, "dir": step_dirname(step)}).encode()


def decode_pointer(data: bytes) -> int | None:
    """The step in a ``latest`` pointer; None when it is not one (never trusted blindly:
    :meth:`CheckpointManager.load_latest` scans for committed checkpoints itself)."""
    try:
        obj = json.loads(data)
        step = obj["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
