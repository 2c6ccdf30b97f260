"""Where the measurement runs: a one-process gloo world here (``--ranks 1``) or a spawned
world of N processes on 127.0.0.1 (``--ranks N``).

The spawned ranks run as ``python -m dcp_plus.cli.bench.world SPEC RANK`` by :func:`measure_in_world` (the
``__main__`` guard also protects the PROCESS executor, which spawns). Rank 0 shows the
progress bar and writes the merged result; the other ranks log to files in the spec's folder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from dcp_plus.cli.bench.config import BenchConfig
from dcp_plus.errors import DcpPlusError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank_processes(commands: list[list[str]], envs: list[dict[str, str]],
                       logs: list[Path], timeout: float, *, cwd: str | os.PathLike | None = None,
                       rank0_stderr: bool = False) -> list[int]:
    """Run one process per rank (``commands[r]`` with ``envs[r]``, output to ``logs[r]``)
    until every one exits or ``timeout`` seconds pass (the rest are killed); their exit
    codes. ``rank0_stderr``: rank 0's stderr stays on this terminal (its progress bar)."""
    procs = []
    for rank, (argv, env) in enumerate(zip(commands, envs, strict=True)):
        with open(logs[rank], "wb") as log:
            procs.append(subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=None if rank0_stderr and rank == 0 else subprocess.STDOUT))
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
    return [p.returncode for p in procs]


def log_tails(codes: list[int], logs: list[Path], chars: int) -> str:
    """The last ``chars`` of each rank's log, headed by its exit code."""
    return "\n".join(f"--- rank {r} (exit {code}) ---\n"
                     + logs[r].read_text(errors="replace")[-chars:]
                     for r, code in enumerate(codes))


def measure_in_process(cfg: BenchConfig) -> dict[str, Any]:
    """:func:`~dcp_plus.cli.bench.measure.measure` in a one-process gloo world (the PROCESS
    executor needs a group); an existing group is used as it is."""
    import torch.distributed as dist

    from dcp_plus.cli.bench.measure import measure

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    try:
        res = measure(cfg)
    finally:
        if owns:
            dist.destroy_process_group()
    res["ranks"] = 1
    return res


def measure_in_world(cfg: BenchConfig, timeout: float = 3600) -> dict[str, Any]:
    """Spawn ``cfg.ranks`` processes, run :func:`~dcp_plus.cli.bench.measure.measure` in each,
    return the merged result.

    Raises:
        DcpPlusError: a rank failed or the world outlived ``timeout`` (with every log tail).
    """
    with tempfile.TemporaryDirectory(prefix="dcpp-bench-world-") as tmp:
        spec = Path(tmp, "spec.json")
        fields = {k: getattr(cfg, k) for k in cfg.__slots__}  # type: ignore[attr-defined]
        spec.write_text(json.dumps({"config": fields, "world": cfg.ranks,
                                    "port": free_port(), "out": tmp}))
        spec.chmod(0o600)  # storage options may hold credentials
        from dcp_plus.cli.logs import child_env

        env = child_env()  # the ranks log at this process's level
        env.setdefault("OMP_NUM_THREADS", "1")
        logs = [Path(tmp, f"rank{rank}.log") for rank in range(cfg.ranks)]
        codes = run_rank_processes(
            [[sys.executable, "-m", "dcp_plus.cli.bench.world", str(spec), str(rank)]
             for rank in range(cfg.ranks)],
            [env] * cfg.ranks, logs, timeout, rank0_stderr=True)
        result = Path(tmp, "result.json")
        if any(codes) or not result.exists():
            tails = log_tails(codes, logs, 3000)
            raise DcpPlusError(f"the {cfg.ranks}-rank benchmark world failed:\n{tails}")
        return dict(json.loads(result.read_text()))


def _main(spec_path: str, rank_arg: str) -> None:
    from dcp_plus.cli.logs import bars_safe, configure_from_env

    configure_from_env()
    with bars_safe():  # rank 0's stderr is the user's terminal: log above its bar
        _run_rank(spec_path, rank_arg)


def _run_rank(spec_path: str, rank_arg: str) -> None:
    import torch.distributed as dist

    from dcp_plus.cli.bench.measure import measure, merge_ranks

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(rank_arg), int(spec["world"])
    cfg = BenchConfig(**spec["config"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    try:
        mine = measure(cfg, rank, world)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(spec["out"], "result.json").write_text(json.dumps(merge_ranks(gathered)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
