"""Processes beside one checkpoint root, for the one-writer tests (``test_root_sharing.py``).

Usage: ``python -m tests.unit._root_child ROLE ROOT OUT_JSON [ARGS_JSON]``. Roles:

- ``hold``: take the root's lease (``lease_timeout`` from ARGS), save step 1, write OUT_JSON
  ``{"ready": pid}``, then wait for ``ROOT/../go``; save step 2 and report its outcome.
- ``take``: construct ``CheckpointManager(root, takeover=True)`` until the lease is granted
  (retrying while the holder still looks alive), save step 100, report.
- ``trainer``: save steps 1..ARGS["saves"] (state :func:`state_at`), report every outcome.
- ``reader``: ``read_only=True``; poll ``load_latest`` ARGS["polls"] times, checking each load
  bit-exact against :func:`state_at` of the step it returned; report the counts.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dcp_plus import CheckpointManager
from dcp_plus.errors import LeaseHeldError


def state_at(step: int) -> dict[str, Any]:
    """The state every role saves at ``step`` (and the reader expects)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.arange(4096) * step,
            "train": {"step": step, "losses": [float(step)] * 3},
            "blob": io.BytesIO(f"step {step}".encode())}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(4096, dtype=torch.int64),
            "train": {"step": -1, "losses": []}, "blob": io.BytesIO()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["train"] == b["train"]
            and a["blob"].getvalue() == b["blob"].getvalue())


def outcome(manager: CheckpointManager, step: int) -> str:
    handle = manager.save(step, state_at(step))
    assert handle is not None
    try:
        handle.result(timeout=120)
        return "committed"
    except Exception as e:
        return f"failed: {e}"


def write(out: str, report: dict[str, Any]) -> None:
    tmp = out + ".tmp"
    Path(tmp).write_text(json.dumps(report))
    os.replace(tmp, out)


def main(role: str, root: str, out: str, args: dict[str, Any]) -> None:
    if role == "hold":
        m = CheckpointManager(root, keep_last=None, interval=1,
                              lease_timeout=args["lease_timeout"])
        first = outcome(m, 1)
        write(out, {"ready": os.getpid(), "first": first})
        go = Path(root).parent / "go"
        while not go.exists():
            time.sleep(0.01)
        write(out, {"ready": os.getpid(), "first": first, "second": outcome(m, 2),
                    "lease_held": m._lease is not None and m._lease.held})
        m.close()
    elif role == "take":
        deadline = time.monotonic() + args.get("patience_s", 60)
        refusals = 0
        while True:
            try:
                m = CheckpointManager(root, keep_last=None, takeover=True,
                                      lease_timeout=args["lease_timeout"])
                break
            except LeaseHeldError:
                refusals += 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        write(out, {"took_over": m.took_over, "refusals": refusals, "saved": outcome(m, 100),
                    "cleaned": m.cleaned})
        m.close()
    elif role == "trainer":
        with CheckpointManager(root, keep_last=args.get("keep_last", 3), interval=1) as m:
            results = {step: outcome(m, step) for step in range(1, args["saves"] + 1)}
        write(out, {"results": results})
    elif role == "reader":
        m = CheckpointManager(root, read_only=True)
        loads, misses, wrong = 0, 0, []
        for _ in range(args["polls"]):
            target = blank()
            step = m.load_latest(target)
            if step is None:
                misses += 1
                continue
            loads += 1
            if not same(target, state_at(step)):
                wrong.append(step)
        m.close()
        write(out, {"loads": loads, "misses": misses, "wrong": wrong})
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3],
         json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
