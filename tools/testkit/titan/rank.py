"""One TorchTitan rank on CPU: apply the CPU shims, then run TorchTitan's own ``train.main()``.

Run as ``python -m tools.testkit.titan.rank <torchtitan arguments>`` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (``tools.testkit.titan.run`` does this).

Shims (TorchTitan 0.3.0 assumes an accelerator):
* device detection: ``torch._utils._get_available_device_type`` answers ``"cpu"`` before
  TorchTitan is imported, so its ``device_type``/``device_module`` are ``cpu``/``torch.cpu``
  and its process group is gloo;
* ``torch.distributed.set_timeout`` (new in torch 2.14, TorchTitan 0.3.0's target; used
  after step 1 to shorten collective timeouts) is a no-op on torch 2.13;
* ``torch.cpu`` gets no-op ``get_device_name``/``get_device_properties``/``memory_stats``/
  ``reset_peak_memory_stats``/``empty_cache``/``set_device`` for TorchTitan's memory monitor;
* ``triton`` (absent beside CPU torch): TorchTitan's expert-parallel Triton kernels module,
  imported at start-up but used only by MoE expert parallelism, is replaced by stubs;
* ``torch.distributed.barrier(device_ids=...)``: gloo takes no device ids, they are dropped;
* recorded for the tests: every logged step's loss (full precision) is appended to
  ``$DCPP_TITAN_LOSSES`` on rank 0; ``$DCPP_TITAN_SAVES`` gets each save's blocking time; ``$DCPP_TITAN_KILL_AT=N`` makes every rank SIGKILL itself
  when step N starts (a deterministic ``kill -9`` of the whole job); with
  ``$DCPP_TITAN_KILL_SETTLED=1`` it first waits for the save in flight to complete
  (``maybe_wait_for_saving()``: its memory record, replica and persist);
  ``$DCPP_TITAN_SERIAL_SAVES=1`` waits so at the start of every step (each save's persist
  ends before the next step: what a test needs to be independent of the machine's load).
Attention (SDPA instead of FlexAttention), SUM reductions and the SPMD backend are set in
the recipe ``tools.testkit.titan.recipe``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch._utils
import torch.distributed as dist


def _stub_triton_kernels() -> None:
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def unavailable(*_: Any, **__: Any) -> Any:
        raise RuntimeError("Triton kernels are not available on this CPU-only test machine")

    def kernel(attr: str) -> Any:
        if attr.endswith("_kernel"):
            return unavailable
        raise AttributeError(attr)

    stub.__getattr__ = kernel  # type: ignore[attr-defined]
    sys.modules[name] = stub


def apply_cpu_shims() -> None:
    _stub_triton_kernels()
    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    barrier = dist.barrier

    def cpu_barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return barrier(*args, **kwargs)

    dist.barrier = cpu_barrier  # type: ignore[assignment]
    if not hasattr(dist, "set_timeout"):  # torch 2.14 API; only shortens hang detection
        dist.set_timeout = lambda timeout, group=None: None  # type: ignore[attr-defined]
    # the device-module calls TorchTitan makes (memory monitor, set_device), as no-ops
    cpu_module: dict[str, Any] = {
        "set_device": lambda *_: None,
        "get_device_name": lambda *_: "cpu",
        "get_device_properties": lambda *_: types.SimpleNamespace(total_memory=1 << 34),
        "reset_peak_memory_stats": lambda *_: None,
        "empty_cache": lambda: None,
        "memory_stats": lambda *_: {},
    }
    for name, fn in cpu_module.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def apply_test_hooks() -> None:
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    losses = os.environ.get("DCPP_TITAN_LOSSES")
    if losses:
        log = MetricsProcessor.log

        def log_loss(self: Any, step: int, global_avg_loss: float, *args: Any,
                     **kwargs: Any) -> Any:
            if dist.get_rank() == 0:
                with open(losses, "a") as f:
                    f.write(json.dumps({"step": step, "loss": float(global_avg_loss),
                                        "t": time.monotonic()}) + "\n")
            return log(self, step, global_avg_loss, *args, **kwargs)

        MetricsProcessor.log = log_loss  # type: ignore[method-assign]
    saves = os.environ.get("DCPP_TITAN_SAVES")
    flush_saves = _record_save_times(saves) if saves else lambda: None
    kill_at = int(os.environ.get("DCPP_TITAN_KILL_AT", "0"))
    settled = os.environ.get("DCPP_TITAN_KILL_SETTLED") == "1"
    serial = os.environ.get("DCPP_TITAN_SERIAL_SAVES") == "1"
    if kill_at or serial:
        train_step = Trainer.train_step

        def step_hooks(self: Any, *args: Any, **kwargs: Any) -> Any:
            if serial or (settled and self.step == kill_at):
                self.checkpointer.maybe_wait_for_saving()
            if self.step == kill_at:
                flush_saves()  # the record of the last save before the kill
                os.kill(os.getpid(), signal.SIGKILL)
            return train_step(self, *args, **kwargs)

        Trainer.train_step = step_hooks  # type: ignore[method-assign]


def _record_save_times(path: str) -> Callable[[], None]:
    """Append, per rank and save, the time ``save()`` and the following
    ``maybe_wait_for_staging()`` held the training loop (any checkpoint manager).

    A save's line is written at the next save (or the last step); returns the function
    that writes a pending one now."""
    import time

    from torchtitan.components.checkpointer import BaseCheckpointManager

    save, wait = BaseCheckpointManager.save, BaseCheckpointManager.maybe_wait_for_staging
    pending: dict[str, Any] = {}

    def flush() -> None:
        if pending:
            with open(path, "a") as f:
                f.write(json.dumps(pending) + "\n")
            pending.clear()

    def timed_save(self: Any, curr_step: int, last_step: bool = False) -> bool:
        t0 = time.perf_counter()
        saved = save(self, curr_step, last_step)
        if saved:
            flush()
            pending.update(rank=dist.get_rank(), step=curr_step, last=last_step,
                           blocking_s=time.perf_counter() - t0, staging_wait_s=0.0)
            if last_step:
                flush()
        return saved

    def timed_wait(self: Any) -> None:
        t0 = time.perf_counter()
        wait(self)
        if pending:
            pending["staging_wait_s"] += time.perf_counter() - t0

    BaseCheckpointManager.save = timed_save  # type: ignore[method-assign]
    BaseCheckpointManager.maybe_wait_for_staging = timed_wait  # type: ignore[method-assign]
    return flush


def main() -> None:
    apply_cpu_shims()
    apply_test_hooks()
    from torchtitan import train

    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    train.main()


if __name__ == "__main__":
    main()
