"""Shaped bursts (issue 19 part 5): ``max_bytes_per_s`` and ``stagger`` on every writer.

The rate assertions are lower bounds on time that only a broken cap can miss: a rank's bucket
grants at most ``cap * T + GRANT`` bytes in any ``T`` seconds, so writing ``B`` bytes takes at
least ``(B - GRANT) / cap`` however slow or loaded the machine is. The multi-rank job is in
``tests/dist/test_rate_cap.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import (
    InvalidOptionError,
    LocalWriter,
    NFSReader,
    NFSWriter,
    ObjectStoreReader,
    ObjectStoreWriter,
    SafeLoadPlanner,
)
from dcp_plus.manager.options import LocalWriterOptions, ObjectStoreWriterOptions
from dcp_plus.shm import SHM_DIR
from dcp_plus.storage.rate import GRANT, RateLimit, shared_bucket, stagger_delay
from tests.conftest import (
    assert_bit_exact,
    child_env,
    load,
    load_target,
    registered_slab,
    worker_pids,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MiB = 1 << 20
CAP = 24 * MiB  # 16 MiB saves: >= 0.5 s capped, a few times faster uncapped here


def rate_state(nbytes: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(nbytes // 4, generator=g),
            "odd": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
            "step": 3}


def tensor_bytes(sd: dict[str, Any]) -> int:
    return sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))


def assert_capped(writer: Any, wall_s: float, nbytes: int, cap: float) -> None:
    """The save of ``nbytes`` (at least) took no less than the cap allows, by the writer's
    own clock and by the caller's."""
    floor = (nbytes - GRANT) / cap
    p = writer.last_persist
    assert p is not None and p.data_bytes >= nbytes
    assert p.write_s >= floor, f"{nbytes} bytes in {p.write_s:.3f} s: over the cap {cap}"
    assert wall_s >= floor
    assert p.bytes_per_s <= cap * p.data_bytes / (p.data_bytes - GRANT)


def leftover_buckets() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"dcpp-{os.getpid()}-rate-")]


# -- the bucket -------------------------------------------------------------------------------

_TAKER = """
import json, sys, time
from dcp_plus.storage.rate import GRANT, RateLimit
bucket = RateLimit(sys.argv[1], float(sys.argv[2])).open()
before = time.monotonic()
after = []
for _ in range(int(sys.argv[3])):
    bucket.take(GRANT)
    after.append(time.monotonic())
print(json.dumps({"before": before, "after": after}))
"""


def test_one_bucket_paces_several_processes_together():
    rate, grants, procs = 256 * MiB, 4, 3  # 12 grants of 4 MiB at 64 grants/s
    with shared_bucket(rate) as bucket:
        assert bucket is not None
        limit = bucket.limit
        assert isinstance(limit, RateLimit) and os.path.exists(f"{SHM_DIR}/{limit.name}")
        children = [subprocess.Popen([sys.executable, "-c", _TAKER, limit.name, str(rate),
                                      str(grants)], stdout=subprocess.PIPE, env=child_env())
                    for _ in range(procs)]
        runs = [json.loads(c.communicate(timeout=60)[0]) for c in children]
    assert all(c.returncode == 0 for c in children)
    assert not os.path.exists(f"{SHM_DIR}/{limit.name}")
    first = min(r["before"] for r in runs)
    last = max(max(r["after"]) for r in runs)
    # shared: the 12th grant starts 11 grant-times after the first (per process: only 3)
    assert last - first >= (procs * grants - 1) * GRANT / rate


def test_uncapped_has_no_bucket():
    with shared_bucket(None) as bucket:
        assert bucket is None


# -- every writer, capped ------------------------------------------------------------------


def slab_state(stack: contextlib.ExitStack, nbytes: int) -> dict[str, Any]:
    """A tensor in a registered slab (written by the worker processes) and one outside."""
    slab = stack.enter_context(registered_slab(nbytes + MiB))
    big = slab.tensor()[:nbytes].view(torch.float32)
    big.copy_(torch.randn(big.numel(), generator=torch.Generator().manual_seed(1)))
    return {"big": big, "plain": torch.arange(1000)}


@pytest.mark.parametrize("slabs", [False, True])
@pytest.mark.parametrize("direct_io", ["auto", False])
def test_local_writer_stays_under_the_cap_bit_exact(tmp_path, slabs, direct_io):
    cap, ckpt = CAP, tmp_path / "ckpt"
    with contextlib.ExitStack() as stack:
        sd = slab_state(stack, 16 * MiB) if slabs else rate_state(16 * MiB)
        expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        writer = LocalWriter(ckpt, max_bytes_per_s=cap, direct_io=direct_io)
        t0 = time.monotonic()
        dcp.save(sd, storage_writer=writer, no_dist=True)
        assert_capped(writer, time.monotonic() - t0, tensor_bytes(expected), cap)
        assert bool(worker_pids()) == slabs  # slab data: written by the worker processes
    assert_bit_exact(load(load_target(expected), ckpt), expected)
    assert not leftover_buckets()


def test_nfs_writer_on_a_mounted_path_stays_under_the_cap(tmp_path):
    cap, sd = CAP, rate_state(16 * MiB, seed=2)
    writer = NFSWriter(tmp_path / "ckpt", max_bytes_per_s=cap)
    t0 = time.monotonic()
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert_capped(writer, time.monotonic() - t0, tensor_bytes(sd), cap)
    out = load_target(sd)
    dcp.load(out, storage_reader=NFSReader(tmp_path / "ckpt"), planner=SafeLoadPlanner(),
             no_dist=True)
    assert_bit_exact(out, sd)


def test_object_store_writer_stays_under_the_cap(tmp_path):
    cap, sd = CAP, rate_state(16 * MiB, seed=3)
    url = f"file://{tmp_path}/ckpt"
    writer = ObjectStoreWriter(url, max_bytes_per_s=cap)
    t0 = time.monotonic()
    dcp.save(sd, storage_writer=writer, no_dist=True)
    assert_capped(writer, time.monotonic() - t0, tensor_bytes(sd), cap)
    out = load_target(sd)
    dcp.load(out, storage_reader=ObjectStoreReader(url), planner=SafeLoadPlanner(),
             no_dist=True)
    assert_bit_exact(out, sd)


def test_stagger_delays_the_data_write_by_the_local_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    writer = LocalWriter(tmp_path / "ckpt", stagger=0.4)
    t0 = time.time()
    dcp.save(rate_state(1 * MiB), storage_writer=writer, no_dist=True)
    p = writer.last_persist
    assert p is not None and p.writing - p.started >= 0.4 and p.started >= t0
    first_file = min(f.stat().st_mtime for f in (tmp_path / "ckpt").glob("*.dcpp"))
    assert first_file >= t0 + 0.4 - 0.02  # file times tick coarsely (a jiffy)


def test_stagger_rule_is_local_rank_times_seconds(monkeypatch):
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert stagger_delay(0.5, rank=11) == 1.5
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "2")  # srun
    assert stagger_delay(0.5, rank=1023) == 1.0
    monkeypatch.delenv("SLURM_LOCALID")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert stagger_delay(0.5, rank=11) == 1.5  # 11 mod 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert stagger_delay(0.5, rank=1023) == 0.0  # never the global rank
    assert stagger_delay(0.0, rank=11) == 0.0


# -- refused settings -----------------------------------------------------------------------

BAD = [({"max_bytes_per_s": 0}, "max_bytes_per_s must be > 0"),
       ({"max_bytes_per_s": -5.0}, "max_bytes_per_s must be > 0"),
       ({"max_bytes_per_s": math.nan}, "max_bytes_per_s must be finite"),
       ({"max_bytes_per_s": math.inf}, "max_bytes_per_s must be finite"),
       ({"max_bytes_per_s": "64MiB"}, "max_bytes_per_s must be a number of bytes per second"),
       ({"max_bytes_per_s": True}, "max_bytes_per_s must be a number of bytes per second"),
       ({"stagger": -1}, "stagger must be >= 0"),
       ({"stagger": math.nan}, "stagger must be finite"),
       ({"stagger": None}, "stagger must be a number"),
       ({"stagger": "1s"}, "stagger must be a number")]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_bad_shaping_settings_are_refused_naming_the_option(tmp_path: Path, bad, message):
    for writer, target in ((LocalWriter, tmp_path), (NFSWriter, tmp_path),
                           (ObjectStoreWriter, "memory://rate")):
        with pytest.raises(ValueError, match=f"{writer.__name__} {message}"):
            writer(target, **bad)
    option = message.split(" ", 1)[0]
    for options in (LocalWriterOptions, ObjectStoreWriterOptions):
        with pytest.raises(InvalidOptionError, match=f"{options.__name__}.{option}: "):
            options(**bad)


def test_shaping_options_reach_the_writer(tmp_path):
    opts = LocalWriterOptions(max_bytes_per_s=128 * MiB, stagger=0.25)
    writer = LocalWriter(tmp_path, **opts.kwargs())
    assert (writer.max_bytes_per_s, writer.stagger) == (128 * MiB, 0.25)
    assert LocalWriterOptions().kwargs()["max_bytes_per_s"] is None
    assert ObjectStoreWriterOptions().kwargs()["stagger"] == 0.0
