"""Restore time per tier, in a restarted process, next to the memory limit.

``python -m benchmarks.tiers --gib 1``: one process saves a state of ``--gib`` GiB (64 MiB
tensors) with ``memory_tier=True`` (the first save durable, the second in memory only), is
ended without cleanup as a crash would, and a new process restores: from memory, then (its
snapshot removed) from durable storage. The memory limit is a copy of the same bytes into
pre-faulted tensors on one thread. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid

import torch

PIECE = 16 << 20  # float32 elements: 64 MiB


def state(gib: float, fill: float) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * (1 << 30)) // (PIECE * 4))
    return {f"t{i}": torch.full((PIECE,), fill + i) for i in range(n)}


def child(root: str, job: str, gib: float, mode: str) -> None:
    from dcp_plus.manager import CheckpointManager
    from dcp_plus.tiers import names

    if mode == "save":
        m = CheckpointManager(root, memory_tier=True, durable_every=2, job_id=job)
        for step in (1, 2):
            m.save(step, state(gib, float(step))).result()
        m.close(keep_snapshots=True)
        return
    dest = state(gib, 0.0)  # allocated and faulted before the clock starts
    t0 = time.perf_counter()
    m = CheckpointManager(root, memory_tier=True, durable_every=2, job_id=job, takeover=True)
    built = time.perf_counter() - t0
    step = m.load_latest(dest)
    took = time.perf_counter() - t0
    assert m.last_restore is not None
    ok = all(torch.equal(v, torch.full((PIECE,), float(step) + i))
             for i, v in enumerate(dest.values()))
    if mode == "memory":
        m.close(keep_snapshots=True)
    else:
        m.close()
    for f in names.listing(job) if mode == "durable" else []:
        names.unlink(f.name)
    print(json.dumps({"step": step, "tiers": m.last_restore.tiers, "construct_s": built,
                      "restore_s": took, "exact": ok}))


def memcpy_s(gib: float) -> float:
    src, dst = state(gib, 1.0), state(gib, 0.0)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for k in src:
            dst[k].copy_(src[k])
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--child", nargs=4)
    a = p.parse_args()
    if a.child:
        child(a.child[0], a.child[1], float(a.child[2]), a.child[3])
        return
    torch.set_num_threads(1)
    root, job = tempfile.mkdtemp(prefix="dcpp-bench-tiers-"), f"b{uuid.uuid4().hex[:10]}"

    def run(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "benchmarks.tiers", "--child", root, job,
                              str(a.gib), mode], check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1]) if mode != "save" else {}

    run("save")
    memory = run("memory")
    from dcp_plus.tiers import names

    for f in names.listing(job):
        names.unlink(f.name)
    durable = run("durable")
    limit = memcpy_s(a.gib)
    print(json.dumps({"gib": a.gib, "memcpy_1_thread_s": limit, "memory": memory,
                      "durable_warm": durable,
                      "memory_vs_memcpy": memory["restore_s"] / limit,
                      "memory_vs_durable": memory["restore_s"] / durable["restore_s"]}))


if __name__ == "__main__":
    main()
