"""Gloo worlds on 127.0.0.1: N spawned processes running named cases or one function, or this
process alone.

Each process pays ~5 s importing torch, so a test spawns one world and runs many cases in it
instead of one world per case::

    results = run_world(4, [("tests.dist.test_reshard:save_sharded", {"path": p}), ...], tmp)
    results["save_sharded"]  # -> {"ok": True, "values": [rank0_value, ...]} or an error
    values = run_ranks(2, fn, root)  # fn(rank, 2, root) on each rank; the values by rank

A case is ``fn(rank, world_size, *args, **kwargs)`` called after ``init_process_group``, with
MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set as torchrun sets them; it
returns a JSON-able value (or None) and raises to fail. After a failed case a rank skips the
rest (their collectives could no longer match) and reports them as skipped.

Ranks run as ``python -m tools.testkit.world SPEC RANK`` (the ``__main__`` guard also protects
``AsyncCheckpointerType.PROCESS``, which spawns).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from dcp_plus.cli.bench.world import log_tails, run_rank_processes
from tools.testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
Case = tuple[str, dict[str, Any]]


def case_name(target: str) -> str:
    return target.rsplit(":", 1)[1]


def run_world(world_size: int, cases: list[Case], workdir: Path, *,
              timeout: float = 240) -> dict[str, dict[str, Any]]:
    """Run ``cases`` (``("module:function", kwargs)``) in order in a fresh ``world_size``-process
    gloo world; logs and results go to ``workdir``.

    Returns, per case name, ``{"ok": bool, "values": [per rank], "errors": {rank: text}}``.
    Raises ``RuntimeError`` with every rank's log tail if a process dies or hangs.
    """
    return _launch(world_size, [(t, [], kw) for t, kw in cases], Path(workdir), timeout,
                   pg_timeout=90)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              timeout: float = 240) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank of a fresh gloo world; the values by rank.

    ``fn`` must be a module-level function of an importable module (``__main__`` of
    ``python -m pkg.mod`` counts as ``pkg.mod``), ``args`` and the values JSON-able.
    Raises ``RuntimeError`` with the failing ranks' tracebacks.
    """
    target = function_target(fn)
    with tempfile.TemporaryDirectory(prefix="dcpp-world-") as tmp:
        res = _launch(world_size, [(target, list(args), {})], Path(tmp), timeout,
                      pg_timeout=timeout)[case_name(target)]
    if not res["ok"]:
        raise RuntimeError("\n".join(f"rank {r} failed:\n{e}" for r, e in res["errors"].items()))
    return list(res["values"])


def function_target(fn: Callable[..., Any]) -> str:
    """``"module:function"`` naming ``fn`` for a spawned rank to import."""
    module = fn.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(f"{fn.__qualname__} is defined in a script run by path; run it as "
                             "`python -m package.module` so that spawned ranks can import it")
        module = spec.name
    if "." in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__} is not a module-level function")
    return f"{module}:{fn.__qualname__}"


def assert_case_ok(results: dict[str, dict[str, Any]], name: str) -> list[Any]:
    """Fail with every failing rank's traceback; returns the per-rank values."""
    res = results[name]
    if not res["ok"]:
        detail = "\n".join(f"--- rank {r} ---\n{e}" for r, e in res["errors"].items())
        raise AssertionError(f"case {name} failed:\n{detail}")
    return list(res["values"])


@contextlib.contextmanager
def single_rank_world() -> Iterator[None]:
    """A 1-rank gloo group in this process (``async_save`` with the PROCESS executor needs
    one); an existing group is used as it is. MASTER_ADDR/MASTER_PORT are set meanwhile (the
    PROCESS executor's daemon reads MASTER_ADDR). On exit DCP's checkpoint daemon, if one was
    started, is stopped before the group goes."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    port = free_port()
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        stop_process_executor()
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_process_executor() -> None:
    """Stop DCP's PROCESS-executor daemon if this process started one (imports torch lazily)."""
    from dcp_plus._compat.torch_dcp import stop_process_executor as stop

    stop()


def _launch(world_size: int, cases: list[tuple[str, list[Any], dict[str, Any]]], workdir: Path,
            timeout: float, *, pg_timeout: float) -> dict[str, dict[str, Any]]:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"world{world_size}.json"
    port = free_port()
    spec.write_text(json.dumps({"world_size": world_size, "port": port, "cases": cases,
                                "out": str(workdir), "pg_timeout_s": pg_timeout}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size))
    logs = [workdir / f"rank{r}.log" for r in range(world_size)]
    codes = run_rank_processes(
        [[sys.executable, "-m", "tools.testkit.world", str(spec), str(rank)]
         for rank in range(world_size)],
        [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(world_size)],
        logs, timeout, cwd=ROOT)

    if any(code != 0 for code in codes):
        raise RuntimeError(f"{world_size}-rank world failed or timed out:\n"
                           f"{log_tails(codes, logs, 4000)}")
    per_rank = [json.loads((workdir / f"result{world_size}_{r}.json").read_text())
                for r in range(world_size)]
    results = {}
    for target, _, _ in cases:
        name = case_name(target)
        outcomes = [pr[name] for pr in per_rank]
        results[name] = {
            "ok": all(o["ok"] for o in outcomes),
            "values": [o.get("value") for o in outcomes],
            "errors": {r: o["error"] for r, o in enumerate(outcomes) if not o["ok"]},
        }
    return results


def _main(spec_path: str, rank_arg: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(rank_arg), spec["world_size"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=spec["pg_timeout_s"]))
    out: dict[str, Any] = {}
    failed = False
    try:
        for target, args, kwargs in spec["cases"]:
            name = case_name(target)
            if failed:
                out[name] = {"ok": False, "error": "skipped after an earlier failure"}
                continue
            module, fn = target.split(":")
            try:
                value = getattr(importlib.import_module(module), fn)(rank, world, *args,
                                                                     **kwargs)
                out[name] = {"ok": True, "value": value}
            except BaseException:  # reported per case; DCP raises CheckpointException
                out[name] = {"ok": False, "error": traceback.format_exc()}
                failed = True
    finally:
        Path(spec["out"], f"result{world}_{rank}.json").write_text(json.dumps(out))
    if not failed:
        dist.barrier()
        stop_process_executor()
    # Skip interpreter teardown: after a failure peers may be stuck in a collective this rank
    # left, and gloo's threads sometimes abort ("terminate called without an active
    # exception") while being destroyed at exit. The results are already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
