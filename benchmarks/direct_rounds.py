"""dcp_plus's durable saves and verified load against the O_DIRECT limits, in interleaved rounds.

    python -m benchmarks.direct_rounds [--size-gib 2] [--rounds 8] [--dir /var/tmp] [--settle 2]

``benchmarks.save_load`` gives the whole table once or twice (stock DCP, torch_checkpointing,
page-cache residency); its cases run minutes apart, and on a virtual disk whose rate drifts by
10-20 % over minutes, a 15 % goal needs more than that. Here each round measures the limits and
dcp_plus's paths back to back, and each path is judged against its own round's limits:

write limit   the state's byte count written with O_DIRECT from huge-page rings by 1, 2 and 4
              streams + fsync (``pwrite_files``); the round's best
read limit    the files of the round's bounce-path checkpoint read with O_DIRECT into huge-page
              rings by 1, 2 and 4 streams (``direct_read``); the round's best
write/read limit + copy   the same with a copy of as many bytes running beside them
              (``CopyBeside``): the floor for saving from and loading into memory O_DIRECT
              cannot address (torch's CPU tensors are 64-byte aligned, O_DIRECT wants 512
              here), which must pass once through aligned buffers
slab          ``dcp.save`` of the state staged in a registered slab (``LocalWriter(workers=2)``),
              workers that wrote the slab before: a training job's second checkpoint on
slab, new workers   the same with the worker pool just restarted (a job's first checkpoint)
bounce        plain ``dcp.save`` of the state with ``LocalWriter()`` (aligned bounce buffers)
verified load ``dcp.load`` of that checkpoint into the state with ``LocalReader`` (checksums
              verified) and ``SafeLoadPlanner``

Every case starts from a dropped page cache after ``--settle`` seconds; the order of the
dcp_plus cases alternates between rounds. The slab path is judged against the write limit, the
bounce path against both write limits, the verified load against both read limits. Prints a table (median, min and max of the per-round
ratios, and median seconds) and, with ``--json``, writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.save_load import SlabState, data_files
from dcp_plus.cli.bench.limits import (
    STREAMS,
    CopyBeside,
    direct_read,
    pwrite_files,
    ring_buffers,
)
from dcp_plus.cli.bench.machine import drop_caches, load1, machine
from dcp_plus.cli.bench.models import gpt2_like_state_dict, iter_tensors, state_dict_nbytes
from dcp_plus.planners import SafeLoadPlanner
from dcp_plus.readers import LocalReader
from dcp_plus.shm import SHM_DIR
from dcp_plus.writers import LocalWriter
from dcp_plus.writers.pool import shared_pool, shutdown_pool

SAVES = ("slab", "slab, new workers", "bounce")
CASES = (*SAVES, "verified load")
LIMITS = ("write limit", "write limit + copy", "read limit", "read limit + copy")
JUDGED = {"slab": ("write limit",), "slab, new workers": ("write limit",),
          "bounce": ("write limit", "write limit + copy"),
          "verified load": ("read limit", "read limit + copy")}
"""Each case's limits: the slab path sends the slab's own pages, the others copy."""


def _timed(fn: Callable[[], object], settle: float) -> float:
    drop_caches([])
    time.sleep(settle)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Rounds:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.sd = gpt2_like_state_dict(size_gib=a.size_gib)
        self.nbytes = state_dict_nbytes(self.sd)
        self.slab = SlabState(self.sd)
        t = time.perf_counter()
        self.slab.copy_in()
        self.first_stage_s = time.perf_counter() - t
        self.rings = ring_buffers(max(STREAMS))
        self.root = tempfile.mkdtemp(prefix="dcpp-rounds-", dir=a.dir)
        self.samples: dict[str, list[float]] = {c: [] for c in (*LIMITS, *CASES)}
        self.ratios: dict[str, list[float]] = {f"{c} / {lim}": [] for c in CASES
                                               for lim in JUDGED[c]}
        self._save_slab(True)  # untimed: the pool started, the slab written once by it

    def _dir(self, name: str) -> str:
        d = os.path.join(self.root, name)
        shutil.rmtree(d, ignore_errors=True)
        return d

    def _save_slab(self, new_workers: bool) -> float:
        if new_workers:
            shutdown_pool()
            shared_pool(2)
        self.slab.copy_in()  # the stager's copy into a reused slab: not part of the persist
        d = self._dir("slab")
        return _timed(lambda: dcp.save(self.slab.state, storage_writer=LocalWriter(d),
                                       no_dist=True), self.a.settle)

    def _save_bounce(self) -> float:
        d = self._dir("bounce")
        return _timed(lambda: dcp.save(self.sd, storage_writer=LocalWriter(d), no_dist=True),
                      self.a.settle)

    def _load(self) -> float:
        for _, t in iter_tensors(self.sd):
            t.zero_()
        d = os.path.join(self.root, "bounce")
        return _timed(lambda: dcp.load(self.sd, storage_reader=LocalReader(d),
                                       planner=SafeLoadPlanner(), no_dist=True), self.a.settle)

    def _write_limit(self, copy: bool) -> float:
        def one(k: int) -> float:
            d = self._dir(f"limit{k}")
            os.makedirs(d)

            def write() -> None:
                with CopyBeside(self.nbytes if copy else 0):
                    pwrite_files(None, self.nbytes, d, k, True, self.rings[:k])
            return _timed(write, self.a.settle)
        try:
            return min(one(k) for k in STREAMS)
        finally:
            for k in STREAMS:
                shutil.rmtree(os.path.join(self.root, f"limit{k}"))

    def _read_limit(self, copy: bool) -> float:
        files = data_files(os.path.join(self.root, "bounce"))
        nbytes = sum(os.path.getsize(f) for f in files)

        def one(k: int) -> float:
            def read() -> None:
                with CopyBeside(nbytes if copy else 0):
                    direct_read(files, k, None, self.rings[:k])
            return _timed(read, self.a.settle)
        return min(one(k) for k in STREAMS)

    def round(self, i: int) -> dict[str, float]:
        saves: dict[str, Callable[[], float]] = {
            "slab": lambda: self._save_slab(False),
            "slab, new workers": lambda: self._save_slab(True),
            "bounce": self._save_bounce,
        }
        reads: dict[str, Callable[[], float]] = {
            "read limit": lambda: self._read_limit(False),
            "read limit + copy": lambda: self._read_limit(True),
            "verified load": self._load,
        }
        row = {"write limit": self._write_limit(False),
               "write limit + copy": self._write_limit(True)}
        for name in (SAVES if i % 2 == 0 else SAVES[::-1]):
            row[name] = saves[name]()
        for name in (reads if i % 2 == 0 else list(reads)[::-1]):  # the bounce checkpoint's
            row[name] = reads[name]()
        for name, s in row.items():
            self.samples[name].append(s)
        for name in CASES:
            for lim in JUDGED[name]:
                self.ratios[f"{name} / {lim}"].append(row[name] / row[lim])
        return row

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.slab.close()
        shutdown_pool()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dir", default="/var/tmp", help="where the checkpoints go (a real disk)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds between dropping the page cache and each case")
    p.add_argument("--json", help="write every sample here")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    r = Rounds(a)
    print(f"{r.nbytes / 1e9:.3f} GB, shared memory {SHM_DIR}, checkpoints under {a.dir}; "
          f"first stage into the slab {r.first_stage_s:.2f} s", flush=True)
    try:
        for i in range(a.rounds):
            row = r.round(i)
            print(f"round {i + 1} (load avg {load1():.2f}): "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()), flush=True)
    finally:
        r.close()
    print("\n| case | median s (min-max) |\n|---|---|")
    for name in (*LIMITS, *CASES):
        x = r.samples[name]
        print(f"| {name} | {statistics.median(x):.3f} ({min(x):.3f}-{max(x):.3f}) |")
    print("\n| case / its round's limit | median (min-max) |\n|---|---|")
    for name, x in r.ratios.items():
        print(f"| {name} | **{statistics.median(x):.3f}x** ({min(x):.2f}-{max(x):.2f}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "machine": machine(), "nbytes": r.nbytes,
                       "shm_dir": SHM_DIR, "first_stage_s": r.first_stage_s,
                       "samples": r.samples, "ratios": r.ratios}, f, indent=1)


if __name__ == "__main__":
    main()
