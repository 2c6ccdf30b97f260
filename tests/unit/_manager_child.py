"""A trainer driven by ``CheckpointManager``, for the kill tests (``test_manager_crash.py``).

Usage: ``python -m tests.unit._manager_child ROOT SPEC_JSON OUT_JSON``. SPEC holds ``until``
(last step to train), ``every`` (EveryN interval), ``keep_last``, ``manager`` (more
``CheckpointManager`` keywords, optional) and ``kills``: a list of
``{"target": "trainer"|"worker", "phase": stage|persist|commit|retention, "nth": n,
"delay_ms": d}``: at the n-th save of this run, in that phase, after ``d`` ms, SIGKILL this
process (trainer) or one of its writer workers (worker). A trainer kill first writes the pids
of its writer workers to OUT_JSON + ".pids".

On start the child resumes with ``load_latest``, checks the loaded state bit-exact against an
uninterrupted reference run to that step, and writes what it found to OUT_JSON; it rewrites
OUT_JSON with the outcome of every save when it finishes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

DIMS = {"vocab": 128, "dim": 32, "layers": 1, "heads": 2}
BALLAST = 3 << 20  # bytes: makes a persist long enough to be interrupted half-way


def build(seed: int = 0) -> tuple[Any, Any, torch.Tensor]:
    from dcp_plus.cli.demo import build as build_model

    model, opt = build_model(seed, **DIMS)
    return model, opt, torch.zeros(BALLAST // 4, dtype=torch.float32)


def step_once(model: Any, opt: Any, ballast: torch.Tensor, step: int) -> None:
    from dcp_plus.cli.demo import train_step

    train_step(model, opt, step, vocab=DIMS["vocab"], batch=4, seq=16)
    ballast.mul_(0.5).add_(float(step))  # deterministic, touches every byte


def state_of(model: Any, opt: Any, ballast: torch.Tensor, step: int) -> dict[str, Any]:
    from dcp_plus.cli.demo import state_of as model_state

    return {**model_state(model, opt, step), "ballast": ballast}


def reference(step: int) -> dict[str, Any]:
    from tests.conftest import clone_state

    model, opt, ballast = build()
    for s in range(1, step + 1):
        step_once(model, opt, ballast, s)
    return clone_state(state_of(model, opt, ballast, step))


def _data_files(path: str) -> bool:
    try:
        return any(n.endswith(".dcpp") for n in os.listdir(path))
    except FileNotFoundError:
        return False


class Killer:
    """The ``on_phase`` hook: carries out the planned kills."""

    def __init__(self, root: str, kills: list[dict[str, Any]], out: str) -> None:
        self.root = root
        self.kills = kills
        self.out = out
        self.saves = 0
        self.done: list[dict[str, Any]] = []

    def __call__(self, phase: str, step: int) -> None:
        if phase == "stage":
            self.saves += 1
        for k in self.kills:
            if k["nth"] == self.saves and k["phase"] == phase and k not in self.done:
                self.done.append(k)
                self.fire(k, step)

    def _worker_pids(self) -> list[int]:
        from dcp_plus.writers import pool

        shared = pool._shared
        return shared.pids if shared is not None and not shared._closed else []

    def fire(self, k: dict[str, Any], step: int) -> None:
        from dcp_plus.manager.naming import step_dirname

        path = os.path.join(self.root, step_dirname(step))
        if k["phase"] == "persist":  # land inside the writing: wait for its first data file
            deadline = time.monotonic() + 20
            while not _data_files(path) and time.monotonic() < deadline:
                time.sleep(0.0005)
        delay = k["delay_ms"] / 1e3
        if k["target"] == "trainer":
            Path(self.out + ".pids").write_text(json.dumps(self._worker_pids()))

            def die() -> None:
                time.sleep(delay)
                Path(self.out + ".pids").write_text(json.dumps(self._worker_pids()))
                os.kill(os.getpid(), signal.SIGKILL)

            if k["phase"] == "stage":  # in the background: the kill lands inside staging
                threading.Thread(target=die, daemon=True).start()
            else:
                die()
        else:
            time.sleep(delay)
            pids = self._worker_pids()
            if pids:
                try:
                    os.kill(pids[k["delay_ms"] % len(pids)], signal.SIGKILL)
                    k["killed"] = True
                except ProcessLookupError:  # already dead and reaped (an earlier kill)
                    pass


def main(root: str, spec_path: str, out: str) -> int:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from dcp_plus.manager import CheckpointManager, LocalWriterOptions
    from dcp_plus.schedule import EveryN
    from tests.conftest import assert_bit_exact

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    killer = Killer(root, spec["kills"], out)
    manager = CheckpointManager(root, keep_last=spec["keep_last"],
                                interval=EveryN(spec["every"]), on_phase=killer,
                                writer_options=LocalWriterOptions(workers=2), takeover=True,
                                **spec.get("manager", {}))
    model, opt, ballast = build()
    # a scratch load target: get_state_dict() of a fresh optimizer takes a zero-lr step
    scratch_model, scratch_opt, scratch_ballast = build(seed=1)
    state = state_of(scratch_model, scratch_opt, scratch_ballast, 0)
    resumed = manager.load_latest(state)
    report: dict[str, Any] = {"pid": os.getpid(), "cleaned": manager.cleaned,
                              "resumed": resumed, "latest_pointer": manager.latest_step()}
    start = 0
    if resumed is not None:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        ballast.copy_(state["ballast"])
        start = int(state["step"])
        assert_bit_exact(state_of(model, opt, ballast, start), reference(start))
        report["bit_exact"] = True
    Path(out).write_text(json.dumps(report))
    manager.guard(opt)
    handles = []
    for step in range(start + 1, spec["until"] + 1):
        step_once(model, opt, ballast, step)
        h = manager.maybe_save(step, state_of(model, opt, ballast, step))
        if h is not None:
            handles.append(h)
    manager.wait()
    saves = []
    for h in handles:
        err = h.done.exception()
        saves.append({"step": h.step, "ok": err is None, "error": None if err is None
                      else f"{type(err).__name__}: {err}"})
    report.update(saves=saves, finished=True, final_step=spec["until"],
                  kills=killer.done, latest_after=manager.latest_step())
    manager.close()
    Path(out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
