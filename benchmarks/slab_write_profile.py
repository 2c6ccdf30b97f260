"""Where the slab path's durable save spends its time, next to the O_DIRECT write limit.

    python -m benchmarks.slab_write_profile [--size-gib 2] [--repeats 3] [--dir /var/tmp]

The GPT-2-like state is staged once into a registered slab. Per repeat, each from a cold page
cache after ``--settle`` seconds (as in ``benchmarks.save_load``):

limit 1/2/4   the O_DIRECT write limit (``dcp_plus.cli.bench.limits.pwrite_files``)
save          ``dcp.save(slab state, LocalWriter(workers=2))``: the whole durable save
hash only     the workers' jobs (captured from that save) replayed in this process, one thread
              per job: xxh3-64 of every range, nothing written
write only    the same jobs written with O_DIRECT as the worker writes them (``worker.write``:
              ``job.streams`` streams of 8 MiB pieces, fsync), no hashing
run_job       what a worker does per job: ``worker.run_job`` (the job as the writer makes it;
              before commit "worker: hash beside the write" it hashed, then wrote; since, it
              hashes on a side thread while writing)
variants      hash on a side thread while writing (this script's own, as a reference);
              2 streams per job; 32 MiB pieces

Threads stand in for the worker processes: xxh3 and pwrite release the GIL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch.distributed.checkpoint as dcp

from benchmarks.save_load import SlabState
from dcp_plus.cli.bench.limits import STREAMS, pwrite_files
from dcp_plus.cli.bench.machine import ForeignCpu, drop_caches, load1, machine
from dcp_plus.cli.bench.models import gpt2_like_state_dict, shape_for_size, state_dict_nbytes
from dcp_plus.storage.fileio import fsync_dir
from dcp_plus.writers import worker
from dcp_plus.writers.local import LocalWriter
from dcp_plus.writers.pool import shutdown_pool


def timed(fn: Callable[[], Any], settle: float) -> tuple[float, float | None]:
    drop_caches([])
    time.sleep(settle)
    with ForeignCpu() as fc:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
    return dt, fc.cores


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--settle", type=float, default=15.0)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sd = gpt2_like_state_dict(shape_for_size(a.size_gib * 2**30))
    nbytes = state_dict_nbytes(sd)
    slab = SlabState(sd)
    slab.copy_in()
    root = tempfile.mkdtemp(prefix="dcpp-profile-", dir=a.dir)
    jobs: list[Any] = []
    results: dict[str, list[float]] = {}

    def save(d: str) -> None:
        w = LocalWriter(d, workers=2)
        real = w._worker_jobs

        def capture(*args: Any) -> Any:
            out = real(*args)
            jobs[:] = out
            return out
        w._worker_jobs = capture  # type: ignore[method-assign]
        dcp.save(slab.state, storage_writer=w, no_dist=True)

    def replay(d: str, how: str, streams: int | None = None, piece: int | None = None) -> None:
        maps = worker._Mappings()
        parent = os.getppid()
        saved_piece = worker.PIECE
        if piece:
            worker.PIECE = piece

        def write(job: Any) -> None:
            worker.write(job, [(foff, maps.view(s, soff, n), soff % worker.DIRECT_ALIGN == 0)
                               for s, soff, foff, n in worker.coalesce(job.ranges)],
                         parent, None)

        def one(job: Any) -> None:
            job = replace(job, path=os.path.join(d, os.path.basename(job.path)),
                          streams=streams or job.streams)
            open(job.path, "wb").close()
            if how == "hash":
                maps.checksums(job.ranges)
            elif how == "write":
                write(job)
            elif how == "overlap":
                with ThreadPoolExecutor(1) as side:
                    sums = side.submit(maps.checksums, job.ranges)
                    write(job)
                    sums.result()
            else:
                worker.run_job(job, maps, parent)
        try:
            with ThreadPoolExecutor(len(jobs)) as ex:
                list(ex.map(one, jobs))
            fsync_dir(d)
        finally:
            worker.PIECE = saved_piece

    cases: list[tuple[str, Callable[[str], Any]]] = [
        *[(f"O_DIRECT limit {k} stream(s)", lambda d, k=k: pwrite_files(
            slab.slab.buffer, nbytes, d, k, True)) for k in STREAMS],
        ("save: LocalWriter slab path (workers=2)", save),
        ("jobs: hash only", lambda d: replay(d, "hash")),
        ("jobs: write only", lambda d: replay(d, "write")),
        ("jobs: run_job (as the worker does)", lambda d: replay(d, "run")),
        ("jobs: hash while writing", lambda d: replay(d, "overlap")),
        ("jobs: write only, 2 streams per job", lambda d: replay(d, "write", streams=2)),
        ("jobs: write only, 32 MiB pieces", lambda d: replay(d, "write", piece=32 << 20)),
        ("jobs: write only, 2 streams, 32 MiB", lambda d: replay(d, "write", 2, 32 << 20)),
    ]
    try:
        for rep in range(a.repeats):
            for name, fn in cases:
                if name.startswith("jobs") and not jobs:
                    continue
                d = os.path.join(root, f"r{rep}")
                os.makedirs(d)
                dt, fc = timed(lambda fn=fn, d=d: fn(d), a.settle)
                results.setdefault(name, []).append(dt)
                print(f"rep {rep + 1} {name}: {dt:.3f}s (foreign {fc})", file=sys.stderr)
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutdown_pool()
    m = machine()
    print(f"{nbytes / 1e9:.2f} GB, {len(jobs)} worker jobs "
          f"({', '.join(str(len(j.ranges)) + ' ranges' for j in jobs)}), "
          f"streams per job {jobs[0].streams if jobs else '?'}; load1 {load1():.2f}; "
          f"commit {m.get('commit', '?')}")
    best = min(statistics.median(results[f"O_DIRECT limit {k} stream(s)"]) for k in STREAMS)
    for name, ts in results.items():
        med = statistics.median(ts)
        print(f"{name:<42} {med:6.3f} s  x limit {med / best:5.2f}  "
              f"runs {', '.join(f'{t:.3f}' for t in ts)}")


if __name__ == "__main__":
    main()
