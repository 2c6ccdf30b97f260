"""The memory tier's restore primitive against a memcpy, one process at a time and all at once.

    python -m benchmarks.tier_primitives [--gib 2] [--procs 2] [--dir /dev/shm] [--piece-kib 1024]

Each of ``--procs`` processes (one torch thread each) writes ``--gib`` GiB into a file in
``--dir`` (as a snapshot in shared memory), then times, in rounds started together by a
barrier: a ``copy_`` of the same bytes between two pre-faulted tensors (the memcpy limit), and
``pread`` of the file in ``--piece-kib`` pieces straight into a pre-faulted tensor with the
xxh3 of each piece taken right after it lands (what ``tiers/verify.py`` does). "alone": the
processes take turns; "at once": all run together and a round lasts as long as its slowest
process. Each figure is the best of 3 rounds. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from dcp_plus.format.values import byte_view

ROUNDS = 3


def _work(rank: int, a: argparse.Namespace, barrier: Any, out: Any) -> None:
    torch.set_num_threads(1)
    n = int(a.gib * (1 << 30))
    piece = a.piece_kib << 10
    src = torch.full((n // 4,), 1.0 + rank).view(torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    path = os.path.join(a.dir, f"dcpp-tier-primitives-{os.getpid()}")
    with open(path, "wb") as f:
        f.write(byte_view(src))
    fd = os.open(path, os.O_RDONLY)
    view = byte_view(dst)

    def memcpy() -> None:
        dst.copy_(src)

    def restore() -> None:
        h = xxhash.xxh3_64()
        for at in range(0, n, piece):
            os.preadv(fd, [view[at:at + piece]], at)
            h.update(view[at:at + piece])

    cases: dict[str, Callable[[], None]] = {"memcpy": memcpy, "pread_xxh3": restore}
    times: dict[str, list[float]] = {}
    try:
        for name, fn in cases.items():
            for mode in ("alone", "at_once"):
                for _ in range(ROUNDS):
                    for turn in range(a.procs if mode == "alone" else 1):
                        barrier.wait()
                        if mode == "alone" and turn != rank:
                            continue
                        t0 = time.perf_counter()
                        fn()
                        times.setdefault(f"{name}_{mode}", []).append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    out.put((rank, times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--piece-kib", type=int, default=1024)
    a = p.parse_args()
    barrier = mp.Barrier(a.procs)
    out: Any = mp.Queue()
    procs = [mp.Process(target=_work, args=(r, a, barrier, out)) for r in range(a.procs)]
    for proc in procs:
        proc.start()
    rows = dict(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    res: dict[str, Any] = {"gib": a.gib, "procs": a.procs, "dir": a.dir,
                           "piece_kib": a.piece_kib}
    for key in rows[0]:
        if key.endswith("alone"):  # each process's own best
            res[key] = max(min(rows[r][key]) for r in rows)
        else:  # per round, the slowest process
            res[key] = min(max(rows[r][key][i] for r in rows) for i in range(ROUNDS))
    for mode in ("alone", "at_once"):
        res[f"ratio_{mode}"] = res[f"pread_xxh3_{mode}"] / res[f"memcpy_{mode}"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
