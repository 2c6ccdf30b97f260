"""2- and 4-rank gloo jobs where one rank is SIGKILLed during a persist: the restarted job
agrees on the step to load — the newest committed one, or an older one when a rank cannot see
the newest (its view of the root lacks it) — and every rank loads it bit-exact."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, child_env, free_port, record_path, wait_until
from tools.testkit.world import assert_case_ok, run_world

THIS = "tests.dist.test_manager_dist"


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if record_path(p).exists())


def resume(rank: int, world: int, roots: list[str]) -> dict[str, Any]:
    """Case: load the latest from this rank's view of the root."""
    import torch

    from dcp_plus.manager import CheckpointManager
    from tests.conftest import assert_bit_exact
    from tests.dist._manager_job import expected

    # a restart after the crash: the killed job's rank 0 still names itself in the lease
    manager = CheckpointManager(roots[rank], keep_last=None, takeover=True)
    target = {f"r{rank}": {"w": torch.zeros(4096)}, "step": 0}
    step = manager.load_latest(target)
    if step is not None:
        assert_bit_exact(target, expected(rank, step))
    manager.close()
    return {"step": step, "cleaned": manager.cleaned}


def resume_shared(rank: int, world: int, roots: list[str]) -> dict[str, Any]:
    """Case: every rank sees the same root."""
    return resume(rank, world, roots)


def resume_lagged(rank: int, world: int, roots: list[str]) -> dict[str, Any]:
    """Case: the last rank's view lacks the newest checkpoint."""
    return resume(rank, world, roots)


def crash_job(tmp_path: Path, world: int, victim: int, kill_step: int) -> Path:
    root = tmp_path / "ckpt"
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"world_size": world, "port": free_port(), "root": str(root),
                                "until": kill_step + 4, "victim": victim,
                                "kill_step": kill_step}))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.dist._manager_job", str(spec),
                               str(r)], cwd=ROOT, env={**child_env(), "OMP_NUM_THREADS": "1"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(world)]
    try:
        wait_until(lambda: procs[victim].poll() is not None, 180, "the victim rank to die")
        assert procs[victim].returncode == -signal.SIGKILL
    finally:  # the survivors hang in a collective: the launcher kills them, as torchrun would
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return root


@pytest.mark.parametrize("world", [2, 4])
def test_restarted_job_agrees_on_the_step_to_load_after_a_rank_is_killed(tmp_path, world):
    kill_step = 8
    root = crash_job(tmp_path, world, victim=world - 1, kill_step=kill_step)
    steps = committed(root)
    assert steps and steps[-1] < kill_step and steps[-1] >= 2
    newest = steps[-1]
    # saves the survivors tried after the kill (rank 0 removes a save it saw fail, the
    # launcher's kill may leave others): the restart reports and removes them
    leftovers = sorted(str(p) for p in root.glob("step_*") if not record_path(p).exists())
    # a lagging view for the last rank: its copy of the root lacks the newest checkpoint
    lagging = tmp_path / "lagging"
    shutil.copytree(root, lagging)
    shutil.rmtree(lagging / f"step_{newest:08d}")
    shared = [str(root)] * world
    lagged = [*shared[:-1], str(lagging)]
    results = run_world(world, [(f"{THIS}:resume_shared", {"roots": shared}),
                                (f"{THIS}:resume_lagged", {"roots": lagged})], tmp_path / "world")
    shared_values = assert_case_ok(results, "resume_shared")
    assert [v["step"] for v in shared_values] == [newest] * world
    assert sorted(shared_values[0]["cleaned"]) == leftovers
    lagged_values = assert_case_ok(results, "resume_lagged")
    assert [v["step"] for v in lagged_values] == [steps[-2]] * world
