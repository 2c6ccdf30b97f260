"""Spawn a gloo world of N processes on 127.0.0.1 and run a list of cases in it.

Each process pays ~5 s importing torch, so a test spawns one world and runs many cases in it
instead of one world per case::

    results = run_world(4, [("tests.dist.test_reshard:save_sharded", {"path": p}), ...])
    results["save_sharded"]  # -> {"ok": True, "values": [rank0_value, ...]} or an error

A case is ``fn(rank, world_size, **kwargs)`` called after ``init_process_group``; it returns
a JSON-able value (or None) and raises to fail. After a failed case a rank skips the rest
(their collectives could no longer match) and reports them as skipped.

Run as ``python -m tests.dist._world SPEC RANK`` (the ``__main__`` guard also protects
``AsyncCheckpointerType.PROCESS``, which spawns).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
Case = tuple[str, dict[str, Any]]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_name(target: str) -> str:
    return target.rsplit(":", 1)[1]


def run_world(world_size: int, cases: list[Case], workdir: Path, *,
              timeout: float = 240) -> dict[str, dict[str, Any]]:
    """Run ``cases`` in order in a fresh ``world_size``-process gloo world.

    Returns, per case name, ``{"ok": bool, "values": [per rank], "errors": {rank: text}}``.
    Raises ``RuntimeError`` with every rank's stderr tail if a process dies or hangs.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"world{world_size}.json"
    spec.write_text(json.dumps({"world_size": world_size, "port": _free_port(),
                                "cases": cases, "out": str(workdir)}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    logs = [workdir / f"rank{r}.log" for r in range(world_size)]
    procs = []
    for rank in range(world_size):
        with open(logs[rank], "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.dist._world", str(spec), str(rank)], cwd=ROOT,
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def tails() -> str:
        return "\n".join(f"--- rank {r} (exit {procs[r].returncode}) ---\n"
                         + logs[r].read_text(errors="replace")[-4000:]
                         for r in range(world_size))

    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{world_size}-rank world failed or timed out:\n{tails()}")
    per_rank = [json.loads((workdir / f"result{world_size}_{r}.json").read_text())
                for r in range(world_size)]
    results = {}
    for target, _ in cases:
        name = case_name(target)
        outcomes = [pr[name] for pr in per_rank]
        results[name] = {
            "ok": all(o["ok"] for o in outcomes),
            "values": [o.get("value") for o in outcomes],
            "errors": {r: o["error"] for r, o in enumerate(outcomes) if not o["ok"]},
        }
    return results


def assert_case_ok(results: dict[str, dict[str, Any]], name: str) -> list[Any]:
    """Fail with every failing rank's traceback; returns the per-rank values."""
    res = results[name]
    if not res["ok"]:
        detail = "\n".join(f"--- rank {r} ---\n{e}" for r, e in res["errors"].items())
        raise AssertionError(f"case {name} failed:\n{detail}")
    return res["values"]


def _main(spec_path: str, rank_arg: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(rank_arg), spec["world_size"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    out: dict[str, Any] = {}
    failed = False
    try:
        for target, kwargs in spec["cases"]:
            name = case_name(target)
            if failed:
                out[name] = {"ok": False, "error": "skipped after an earlier failure"}
                continue
            module, fn = target.split(":")
            try:
                value = getattr(importlib.import_module(module), fn)(rank, world, **kwargs)
                out[name] = {"ok": True, "value": value}
            except BaseException:  # reported per case; DCP raises CheckpointException
                out[name] = {"ok": False, "error": traceback.format_exc()}
                failed = True
    finally:
        Path(spec["out"], f"result{world}_{rank}.json").write_text(json.dumps(out))
    if not failed:
        dist.barrier()
    # Skip interpreter teardown: after a failure peers may be stuck in a collective this rank
    # left, and gloo's threads sometimes abort ("terminate called without an active
    # exception") while being destroyed at exit. The results are already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
