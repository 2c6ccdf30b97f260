"""The bounce path's O_DIRECT request size, in interleaved rounds against the write limit.

A plain ``dcp.save`` into a :class:`~dcp_plus.writers.LocalWriter` copies every tensor into
page-aligned bounce buffers and writes each with one O_DIRECT ``pwrite``
(:mod:`dcp_plus.writers.bounce`). This compares buffer sizes (``--chunks-mib``, default
4 and 64: the old and the new :data:`~dcp_plus.storage.direct.BOUNCE_BYTES`) in one process:
each round saves once per size (order reversed every other round) and measures the 4-stream
O_DIRECT write limit, every save from a dropped page cache. A size is tried by giving the
bounce writer a pool of that size for the duration of its saves (the module's chunk and
pool, swapped back afterwards). Prints each round and the medians, with ratios to the
medians' write limit.

    python -m benchmarks.bounce_chunks --size-gib 2 --rounds 6
    python -m benchmarks.bounce_chunks --size-gib 8 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator

import torch.distributed.checkpoint as dcp

from dcp_plus.cli.bench.limits import pwrite_files, ring_buffers
from dcp_plus.cli.bench.machine import drop_caches, load1, machine
from dcp_plus.cli.bench.models import gpt2_like_state_dict, state_dict_nbytes
from dcp_plus.planners import CachedSavePlanner
from dcp_plus.storage.buffers import BufferPool
from dcp_plus.writers import LocalWriter, bounce

LIMIT = "write limit (4 streams)"


@contextlib.contextmanager
def bounce_chunk(pool: BufferPool) -> Iterator[None]:
    """The bounce writer writes ``pool.size`` bytes per request from ``pool`` meanwhile."""
    saved = bounce.BOUNCE_BYTES, bounce.bounce_pool
    bounce.BOUNCE_BYTES, bounce.bounce_pool = pool.size, pool
    try:
        yield
    finally:
        bounce.BOUNCE_BYTES, bounce.bounce_pool = saved


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--chunks-mib", default="4,64", help="bounce buffer sizes, comma-separated")
    p.add_argument("--dir", default="/var/tmp", help="where the checkpoints are written")
    p.add_argument("--settle", type=float, default=1.0, help="seconds after dropping caches")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    # kept as the process pool keeps its own: one per stream and one being filled, no idle unmap
    pools = {int(m): BufferPool(int(m) << 20, keep=bounce.bounce_pool.keep, idle_s=None)
             for m in args.chunks_mib.split(",")}
    sd = gpt2_like_state_dict(size_gib=args.size_gib)
    nbytes = state_dict_nbytes(sd)
    planner = CachedSavePlanner()
    rings = ring_buffers(4)
    root = tempfile.mkdtemp(prefix="dcpp-bounce-chunks-", dir=args.dir)
    print(machine())
    print(f"{nbytes / 1e9:.3f} GB, checkpoints under {args.dir}")

    def timed(fn: Callable[[], object]) -> float:
        drop_caches([root])
        time.sleep(args.settle)
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def save(mib: int) -> float:
        d = os.path.join(root, "save")
        shutil.rmtree(d, ignore_errors=True)
        with bounce_chunk(pools[mib]):
            return timed(lambda: dcp.save(sd, storage_writer=LocalWriter(d), planner=planner,
                                          no_dist=True))

    def limit() -> float:
        d = os.path.join(root, "limit")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        try:
            return timed(lambda: pwrite_files(None, nbytes, d, 4, True, rings))
        finally:
            shutil.rmtree(d, ignore_errors=True)

    times: dict[str, list[float]] = {f"{m} MiB": [] for m in pools}
    times[LIMIT] = []
    try:
        save(min(pools))  # untimed: the planner's first save
        for r in range(args.rounds):
            order = sorted(pools) if r % 2 == 0 else sorted(pools, reverse=True)
            for mib in order:
                times[f"{mib} MiB"].append(save(mib))
            times[LIMIT].append(limit())
            print(f"round {r + 1} (load avg {load1():.2f}): "
                  + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for pool in pools.values():
            pool.close()
    lim = statistics.median(times[LIMIT])
    print("\n| bounce buffer | median s (min-max) | / write limit's median |\n|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}) | "
              f"{statistics.median(v) / lim:.3f}x |")


if __name__ == "__main__":
    main()
