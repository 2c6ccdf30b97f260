"""Run as an unprivileged user by ``test_manager.py``: save into a root it may not write.

Usage: ``python -m tests.unit._manager_perm_child ROOT OUT_JSON``.
"""

from __future__ import annotations

import json
import sys

import torch


def main(root: str, out: str) -> int:
    from dcp_plus.manager import CheckpointManager

    w = torch.ones(1024)
    errors = []
    with CheckpointManager(root, keep_last=None) as manager:
        for step in (5, 6):
            w.add_(1.0)  # training goes on between the failing saves
            err = manager.save(step, {"w": w, "step": step}).done.exception()
            errors.append(None if err is None else f"{type(err).__name__}: {err}")
        listed = [c.step for c in manager.list()]
    with open(out, "w") as f:
        json.dump({"errors": errors, "listed": listed, "w0": float(w[0])}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
