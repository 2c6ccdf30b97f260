"""The torch_checkpointing rows of ``benchmarks.save_load``: meta-pytorch's
``CheckpointManager`` with and without its direct I/O (``use_direct_io``).

They run in a phase of their own at the end of each repeat, after the other saves and loads,
with the stager slab released: torch_checkpointing stages into shared memory of its own
(the size of the state, kept by its manager), and the state + its staging + the slab would
not fit at 8 GiB. Each manager is made, its staging pre-allocated (``prewarm_staging``,
untimed: like the reused slab of the dcp_plus rows), one save timed from the call until its
write future is done (no fsync: torch_checkpointing does not sync), then closed. Its
``use_direct_io=True`` save fails on ext4 (O_DIRECT open, then ``torch.save``'s unaligned
writes: ``EINVAL``); the row then shows the error. Both readers load the ``use_direct_io=False``
checkpoint from a cold page cache, into the state's own tensors, checked bit-exact.

Needs ``pip install torch-checkpointing`` (the ``bench`` extra); without it the rows say why.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any, Protocol

from dcp_plus.cli.bench.cases import TorchCheckpointingCase, torch_checkpointing_status
from dcp_plus.cli.bench.models import state_dict_nbytes

W_TC = "save: torch_checkpointing use_direct_io=False (no fsync)"
W_TC_DIRECT = "save: torch_checkpointing use_direct_io=True, its default (no fsync)"
R_TC = "load: torch_checkpointing use_direct_io=False"
R_TC_DIRECT = "load: torch_checkpointing use_direct_io=True"
SAVES = [W_TC, W_TC_DIRECT]
LOADS = [R_TC, R_TC_DIRECT]


class Bench(Protocol):
    """What this phase uses of ``save_load.Bench``."""

    sd: dict[str, Any]
    samples: dict[str, list[Any]]
    na: dict[str, str]

    def _measure(self, fn: Callable[[], Any], cold: list[str] | None = None,
                 leaves: list[str] | None = None) -> Any: ...

    def load_into_state(self, run: Callable[[], Any], d: str) -> Any: ...


def missing() -> str | None:
    """Why the rows cannot run (torch_checkpointing not importable), or None."""
    return torch_checkpointing_status()


def _error(e: BaseException) -> str:
    text = str(e)
    for marker in ("OSError: [Errno", "RuntimeError: [enforce"):
        at = text.find(marker)  # the worker's traceback: keep its root cause
        if at >= 0:
            return f"failed: {text[at:].splitlines()[0]}"
    return f"failed: {type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _memory_short(sd: dict[str, Any]) -> str | None:
    """Why its staging copy of ``sd`` would not fit in memory now (skip, not OOM), or None."""
    need = 1.1 * state_dict_nbytes(sd)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f
                     if line.startswith("MemAvailable:"))
    if avail >= need:
        return None
    return (f"skipped: its staging copy needs {need / 2**30:.1f} GiB, "
            f"{avail / 2**30:.1f} GiB available")


def _case(direct: bool, sd: dict[str, Any]) -> TorchCheckpointingCase:
    case = TorchCheckpointingCase(direct_io=direct)
    case.manager.prewarm_staging(sd)
    fut = getattr(case.manager, "_prewarm_staging_future", None)
    if fut is not None:
        fut.result()
    return case


def _save(bench: Bench, direct: bool, d: str, path: str) -> Any:
    """One timed save by a fresh manager: its sample, or why it failed. The manager and its
    staging memory are gone when this returns (a closed manager still holds them)."""
    case = _case(direct, bench.sd)
    try:
        return bench._measure(lambda: case.save(bench.sd, path), leaves=[d])
    except Exception as e:  # its direct save on ext4: EINVAL (see the module doc)
        return _error(e)
    finally:
        try:
            case.close()
        except Exception:  # noqa: S110 - close re-raises a failed write: reported above
            pass


def _load(bench: Bench, direct: bool, path: str) -> Any:
    case = TorchCheckpointingCase(direct_io=direct)
    try:  # a failed load leaves the state zeroed: it ends the benchmark
        return bench.load_into_state(lambda: case.load(bench.sd, path), path)
    finally:
        case.close()


def run_phase(bench: Bench, root: str, rep: int, log: Callable[[str], None]) -> int:
    """One repeat's torch_checkpointing saves and loads; returns the rows it ran."""
    saved: str | None = None
    for direct, name in ((False, W_TC), (True, W_TC_DIRECT)):
        d = os.path.join(root, f"r{rep}-tc-{int(direct)}")
        os.makedirs(d)
        path = os.path.join(d, "ckpt")
        why = _memory_short(bench.sd)
        result = why if why else _save(bench, direct, d, path)
        gc.collect()
        if isinstance(result, str):
            bench.na[name] = result
            log(f"  {name}: {result}")
            continue
        bench.samples[name].append(result)
        if not direct:
            saved = path
    if saved is None:
        for name in LOADS:
            bench.na[name] = f"n/a: no checkpoint ({bench.na.get(W_TC, '')})"
        return len(SAVES)
    for direct, name in ((False, R_TC), (True, R_TC_DIRECT)):
        bench.samples[name].append(_load(bench, direct, saved))
        gc.collect()
    return len(SAVES) + len(LOADS)
