"""dcp_plus's durable saves and verified load against the O_DIRECT limits, in interleaved rounds.

    python -m benchmarks.direct_rounds [--size-gib 2] [--rounds 8] [--dir /var/tmp] [--settle 2]

``benchmarks.save_load`` gives the whole table once or twice (stock DCP, torch_checkpointing,
page-cache residency); its cases run minutes apart, and on a virtual disk whose rate drifts by
10-20 % over minutes a 15 % goal needs more than that. Here each round measures the limits and
dcp_plus's paths back to back, and each path is judged against its own round's limits:

write limit     the state's byte count written with O_DIRECT from huge-page rings by 1, 2 and 4
                streams + fsync (``pwrite_files``); the round's best
read limit      the files of the round's bounce-path checkpoint read with O_DIRECT into
                huge-page rings by 1, 2 and 4 streams (``direct_read``); the round's best
read limit, torch memory   the same reads into one CPU tensor of the checkpoint's size
                that torch allocated (as it allocates the state: 4 KiB pages, or 2 MiB ones
                under ``THP_MEM_ALLOC_ENABLE=1``), faulted in before: what the device gives
                into memory of the state's kind, scattered over as much of it (skipped when
                ``MemAvailable`` cannot hold another copy of the state)
read limit, state memory   the same reads into the state's own tensors (their 4 KiB-aligned
                interiors, in state order; a scratch buffer takes the few MiB of small
                tensors and page edges): what the device gives into the very pages the load
                fills, however physically scattered (``benchmarks.state_memory``). It
                overwrites the state, so it always runs right before the verified load,
                which puts the state back. The mean length of the state's physical page
                runs (``/proc/self/pagemap``, as root) is printed at the start and the end
write limit, slab memory   the same writes from the slab's own shared memory (4 KiB pages
                on ``/dev/shm`` here, 2 MiB ones on a ``huge=always`` ``DCPP_SHM_DIR``):
                what the device takes from the pages the slab path sends
... + copy      the same timed inside a ``CopyBeside`` of the state's byte count: the floor for
                saving from and loading into memory O_DIRECT cannot address (torch's CPU
                tensors are 64-byte aligned, O_DIRECT wants 512 here), which must pass once
                through aligned buffers
slab            ``dcp.save`` of the state staged in a registered slab, ``LocalWriter(workers=2)``
                whose workers wrote the slab before, and a ``CachedSavePlanner`` that planned
                it before (a training job's second checkpoint on, as the README plugs us in)
slab, new workers   the same, the worker pool restarted just before (a job's first checkpoint)
bounce          ``dcp.save`` of the state itself (not staged) with ``LocalWriter()`` and a
                warm ``CachedSavePlanner``: aligned bounce buffers, kept from the save before
                (the pool keeps them for the process's life, as the stager keeps its slabs)
bounce, DCP's planner   the same with DCP's ``DefaultSavePlanner`` (plain ``dcp.save``: what
                earlier sessions' "bounce" rows measured)
verified load   ``dcp.load`` of that checkpoint into the state (zeroed first, checked after)
                with ``LocalReader`` (checksums verified) and ``SafeLoadPlanner``; read bounce
                and side buffers mapped afresh, as for a job's restore (its processes' first
                load)

``THP_MEM_ALLOC_ENABLE=1 python -m benchmarks.direct_rounds ...`` has torch allocate the state
(and the torch-memory limit's tensor) 4 KiB-aligned in 2 MiB pages where it can; the header
says how much of the state got them.

Each limit is the best of 1, 2 and 4 streams, judged two ways. Per round, the best of that
round's three (``/ its round's limit``): the minimum of three noisy samples, which on a device
whose rate moves 10-20 % between transfers sits below any one transfer's typical time, so a case
measured once per round carries that bias in its ratio. And per stream count: the count whose
median over rounds is the best, each round's case over that count's transfer in the same round
(``/ best stream count``).

Every case starts from a dropped page cache (``drop_caches``, or evicting the benchmark's files
when not root) after ``--settle`` seconds. Within a round the write limits and the saves, and
the read limits and the load (the state-memory limit always just before it), swap order every
other round, as do the saves among themselves.
The slab path is judged against the write limit and the one from its slab's memory, the
bounce path against the write limit with and without a copy beside it, the verified load
against every read limit. Prints a table (median, min and max over rounds), each limit by
stream count with one stream's time over the best count's (within :data:`CAPPED` for every
limit: the device ran at a rate cap any request pattern reaches, which the run says), and, with
``--json``, writes every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from benchmarks.save_load import SlabState, data_files
from benchmarks.state_memory import contiguity, interiors, state_scatter
from dcp_plus.cli.bench.copy_beside import CopyBeside, beside_buffers
from dcp_plus.cli.bench.limits import (
    STREAMS,
    direct_read,
    pwrite_files,
    read_span,
    ring_buffers,
)
from dcp_plus.cli.bench.machine import drop_caches, load1, machine
from dcp_plus.cli.bench.models import gpt2_like_state_dict, iter_tensors, state_dict_nbytes
from dcp_plus.format.values import byte_view
from dcp_plus.planners import CachedSavePlanner, SafeLoadPlanner
from dcp_plus.readers import LocalReader
from dcp_plus.shm import SHM_DIR
from dcp_plus.storage.direct_extents import read_bounce_pool, read_side_pool
from dcp_plus.writers import LocalWriter
from dcp_plus.writers.pool import shared_pool, shutdown_pool

SAVES = ("slab", "slab, new workers", "bounce", "bounce, DCP's planner")
CASES = (*SAVES, "verified load")
LIMITS = ("write limit", "write limit + copy", "write limit, slab memory", "read limit",
          "read limit + copy", "read limit, torch memory", "read limit, state memory")
JUDGED = {"slab": ("write limit", "write limit, slab memory"),
          "slab, new workers": ("write limit", "write limit, slab memory"),
          "bounce": ("write limit", "write limit + copy"),
          "bounce, DCP's planner": ("write limit", "write limit + copy"),
          "verified load": ("read limit", "read limit + copy", "read limit, torch memory",
                            "read limit, state memory")}
"""Each case's limits: the slab path sends the slab's own pages, the others copy."""
CAPPED = 1.05
"""A limit whose one stream is within this of its best stream count's time: the device is
capped (by the host: on the dev VM, 1.9 GB/s one day, 2.6 and more another)."""


def _in_order(names: list[str], flip: bool) -> list[str]:
    return names[::-1] if flip else names


class Rounds(contextlib.AbstractContextManager["Rounds"]):
    """The state, its slab, the limits' buffers and a scratch directory under ``args.dir``;
    :meth:`run_round` measures every case once; leaving the ``with`` block frees it all."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sd = gpt2_like_state_dict(size_gib=args.size_gib)
        self.nbytes = state_dict_nbytes(self.sd)
        self.state_huge = _anon_huge_bytes()  # the state is all this process has mapped yet
        self.sample = [(t, t.flatten()[:4096].clone())
                       for _, t in list(iter_tensors(self.sd))[:8]]
        self.slab = SlabState(self.sd)
        self.root = tempfile.mkdtemp(prefix="dcpp-rounds-", dir=args.dir)
        self.samples: dict[str, list[float]] = {c: [] for c in (*LIMITS, *CASES)}
        self.by_streams: dict[str, dict[int, list[float]]] = {
            lim: {k: [] for k in STREAMS} for lim in LIMITS}
        self.planners = {"slab": CachedSavePlanner(), "bounce": CachedSavePlanner()}
        self.drop_method = "?"

    def prepare(self) -> None:
        """Stage the slab, make the limits' buffers, and save once from the slab untimed (the
        pool started, the slab written once by its workers)."""
        t = time.perf_counter()
        self.slab.copy_in()
        self.first_stage_s = time.perf_counter() - t
        self.rings = ring_buffers(max(STREAMS))
        beside_buffers()
        self._save_slab(True)
        self._save_bounce()  # its planner's first save
        self.torch_memory = _torch_memory(self.nbytes)  # last: with the pools' memory taken
        files = data_files(os.path.join(self.root, "bounce"))
        tensors = [t for _, t in iter_tensors(self.sd)]
        self.state_memory = state_scatter(tensors, read_span(files))
        self.contiguity = contiguity(interiors(tensors))

    def _timed(self, fn: Callable[[], object]) -> float:
        """``fn``'s seconds, from a dropped page cache after ``--settle`` seconds."""
        self.drop_method = drop_caches([self.root])
        time.sleep(self.args.settle)
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

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
        return self._timed(lambda: dcp.save(self.slab.state,
                                            storage_writer=LocalWriter(d, workers=2),
                                            planner=self.planners["slab"], no_dist=True))

    def _save_bounce(self, dcp_planner: bool = False) -> float:
        d = self._dir("bounce")
        planner = DefaultSavePlanner() if dcp_planner else self.planners["bounce"]
        return self._timed(lambda: dcp.save(self.sd, storage_writer=LocalWriter(d),
                                            planner=planner, no_dist=True))

    def _load(self) -> float:
        for _, t in iter_tensors(self.sd):
            t.zero_()
        read_bounce_pool.release_idle()
        read_side_pool.release_idle()
        d = os.path.join(self.root, "bounce")
        s = self._timed(lambda: dcp.load(self.sd, storage_reader=LocalReader(d),
                                         planner=SafeLoadPlanner(), no_dist=True))
        if not all(torch.equal(t.flatten()[:4096], want) for t, want in self.sample):
            raise RuntimeError("the verified load did not restore the state it saved")
        return s

    def _best_of_streams(self, limit: str, transfer: Callable[[int], object], copy: bool,
                         after: Callable[[int], object] = lambda k: None) -> float:
        """The best time of ``transfer(k)`` over :data:`STREAMS`, each inside a
        :class:`CopyBeside` of the state's byte count with ``copy``; ``after(k)`` untimed.
        Each ``k``'s time is kept under ``limit`` in :attr:`by_streams`."""
        def one(k: int) -> float:
            beside = CopyBeside(self.nbytes) if copy else contextlib.nullcontext()

            def run() -> None:
                with beside:
                    transfer(k)
            try:
                s = self._timed(run)
            finally:
                after(k)
            self.by_streams[limit][k].append(s)
            return s
        return min(one(k) for k in STREAMS)

    def _write_limit(self, name: str, copy: bool = False,
                     source: memoryview | None = None) -> float:
        """The write limit ``name``: from the huge-page rings, or from ``source``."""
        dirs = {k: self._dir(f"limit{k}") for k in STREAMS}
        for d in dirs.values():
            os.makedirs(d)
        return self._best_of_streams(
            name, lambda k: pwrite_files(source, self.nbytes, dirs[k], k, True,
                                         None if source is not None else self.rings[:k]),
            copy, after=lambda k: shutil.rmtree(dirs[k], ignore_errors=True))

    def _read_limit(self, copy: bool) -> float:
        files = data_files(os.path.join(self.root, "bounce"))
        name = "read limit + copy" if copy else "read limit"
        return self._best_of_streams(name,
                                     lambda k: direct_read(files, k, None, self.rings[:k]), copy)

    def _read_limit_torch(self) -> float:
        files = data_files(os.path.join(self.root, "bounce"))
        assert self.torch_memory is not None
        into = _aligned_bytes(self.torch_memory)
        return self._best_of_streams("read limit, torch memory",
                                     lambda k: direct_read(files, k, into), False)

    def _read_limit_state(self) -> float:
        files = data_files(os.path.join(self.root, "bounce"))
        return self._best_of_streams("read limit, state memory",
                                     lambda k: direct_read(files, k, self.state_memory), False)

    def run_round(self, i: int) -> dict[str, float]:
        """Every case once (the order flipped in odd rounds); their seconds by name."""
        flip = i % 2 == 1
        cases: dict[str, Callable[[], float]] = {
            "write limit": lambda: self._write_limit("write limit"),
            "write limit + copy": lambda: self._write_limit("write limit + copy", copy=True),
            "write limit, slab memory": lambda: self._write_limit(
                "write limit, slab memory", source=self.slab.slab.buffer),
            "slab": lambda: self._save_slab(False),
            "slab, new workers": lambda: self._save_slab(True),
            "bounce": self._save_bounce,
            "bounce, DCP's planner": lambda: self._save_bounce(dcp_planner=True),
            # the reads need the bounce checkpoint
            "read limit": lambda: self._read_limit(False),
            "read limit + copy": lambda: self._read_limit(True),
            "read limit, torch memory": self._read_limit_torch,
            "read limit, state memory": self._read_limit_state,
            "verified load": self._load,
        }
        limits = ["write limit", "write limit + copy", "write limit, slab memory"]
        saves = list(SAVES)
        reads = ["read limit", "read limit + copy"]
        if self.torch_memory is not None:
            reads.append("read limit, torch memory")
        reads = _in_order(reads, flip)
        # the state-memory limit overwrites the state: the load right after puts it back
        loading = ["read limit, state memory", "verified load"]
        reads = [*loading, *reads] if flip else [*reads, *loading]
        row = {name: cases[name]() for name in [*_in_order(limits + saves, flip), *reads]}
        for name, s in row.items():
            self.samples[name].append(s)
        return row

    def ratios(self) -> dict[str, list[float]]:
        """Per case and each of its limits, the case's time over its round's limit, by round."""
        return {f"{c} / {lim}": [a / b for a, b in zip(self.samples[c], self.samples[lim],
                                                       strict=True)]
                for c in CASES for lim in self.judged(c)}

    def judged(self, case: str) -> list[str]:
        """The limits ``case`` is judged against that were measured."""
        return [lim for lim in JUDGED[case] if self.samples[lim]]

    def best_streams(self, limit: str) -> int:
        """The stream count whose median time over rounds is the best for ``limit``."""
        return min(STREAMS, key=lambda k: statistics.median(self.by_streams[limit][k]))

    def ratios_by_streams(self) -> dict[str, list[float]]:
        """Per case and each of its limits, by round, the case's time over the same round's
        transfer at the limit's :meth:`best_streams`."""
        return {f"{c} / {lim} ({self.best_streams(lim)} streams)": [
                    a / b for a, b in zip(self.samples[c],
                                          self.by_streams[lim][self.best_streams(lim)],
                                          strict=True)]
                for c in CASES for lim in self.judged(c)}

    def __exit__(self, *exc: Any) -> None:
        shutdown_pool()  # its workers map the slab
        shutil.rmtree(self.root, ignore_errors=True)
        self.slab.close()


def _thp_setting() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text.partition("[")[2].partition("]")[0] or text.strip()


def _anon_huge_bytes() -> int:
    """This process's anonymous memory in transparent huge pages."""
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) << 10 for line in f
                     if line.startswith("AnonHugePages:")), 0)


def _torch_memory(nbytes: int) -> torch.Tensor | None:
    """A faulted-in uint8 CPU tensor for the state's bytes rounded up per file (plus slack),
    allocated by torch as the state was; None when ``MemAvailable`` lacks room for it and
    1 GiB more."""
    need = nbytes + (64 << 20)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    if avail < need + (1 << 30):
        return None
    t = torch.empty(need, dtype=torch.uint8)
    t.zero_()
    return t


def _aligned_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes from its first 4 KiB boundary on (O_DIRECT's alignment)."""
    skip = -t.data_ptr() % 4096
    return byte_view(t)[skip:]


def _pages(mean: float | None) -> str:
    return "(unknown: page frames hidden)" if mean is None else f"{mean:.1f} pages"


def _report(r: Rounds) -> None:
    print("\n| case | median s (min-max) |\n|---|---|")
    for name in (*LIMITS, *CASES):
        x = r.samples[name]
        if not x:
            print(f"| {name} | not measured (too little memory for another copy) |")
            continue
        print(f"| {name} | {statistics.median(x):.3f} ({min(x):.3f}-{max(x):.3f}) |")
    print("\n| limit, by stream count | " + " | ".join(f"{k}" for k in STREAMS)
          + f" | {STREAMS[0]} / best |\n|---|" + "---|" * (len(STREAMS) + 1))
    gains = []
    for lim in (lim for lim in LIMITS if r.samples[lim]):
        medians = [statistics.median(r.by_streams[lim][k]) for k in STREAMS]
        gains.append(medians[0] / min(medians))
        print(f"| {lim} | " + " | ".join(f"{m:.3f}" for m in medians)
              + f" | {gains[-1]:.3f}x |")
    if max(gains) < CAPPED:
        print(f"\n{STREAMS[0]} stream is within {CAPPED - 1:.0%} of the best for every limit: "
              "the device ran at a rate cap that any request pattern reaches, so the ratios "
              "below measure the paths' fixed costs and CPU, not their I/O pattern")
    for title, ratios in (("its round's limit", r.ratios()),
                          ("best stream count", r.ratios_by_streams())):
        print(f"\n| case / {title} | median (min-max) |\n|---|---|")
        for name, x in ratios.items():
            print(f"| {name} | **{statistics.median(x):.3f}x** ({min(x):.2f}-{max(x):.2f}) |")


def round_args(doc: str, argv: list[str] | None, rounds: int,
               settle: float) -> argparse.Namespace:
    """The arguments of a benchmark in rounds: ``--size-gib``, ``--rounds``, ``--dir``,
    ``--settle`` and ``--json``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--dir", default="/var/tmp", help="where the checkpoints go (a real disk)")
    p.add_argument("--settle", type=float, default=settle,
                   help="seconds between dropping the page cache and each case")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = round_args(__doc__, argv, rounds=8, settle=2.0)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    with Rounds(args) as r:
        r.prepare()
        print(f"{r.nbytes / 1e9:.3f} GB, shared memory {SHM_DIR}, checkpoints under "
              f"{args.dir}; first stage into the slab {r.first_stage_s:.2f} s; the state in "
              f"2 MiB pages: {r.state_huge / max(r.nbytes, 1):.0%} (THP_MEM_ALLOC_ENABLE="
              f"{os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, THP {_thp_setting()}); "
              f"read limit into torch memory: "
              f"{'measured' if r.torch_memory is not None else 'skipped (memory)'}; "
              f"the state's pages in physical runs of {_pages(r.contiguity)} on average",
              flush=True)
        for i in range(args.rounds):
            row = r.run_round(i)
            print(f"round {i + 1} (load avg {load1():.2f}, cache: {r.drop_method}): "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()), flush=True)
    end = contiguity(interiors([t for _, t in iter_tensors(r.sd)]))
    print(f"\nthe state's pages at the end: physical runs of {_pages(end)} on average")
    _report(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine(), "nbytes": r.nbytes,
                       "shm_dir": SHM_DIR, "first_stage_s": r.first_stage_s,
                       "state_huge_bytes": r.state_huge,
                       "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                       "thp": _thp_setting(), "torch_memory_measured": r.torch_memory is not None,
                       "state_contiguity_pages": [r.contiguity, end],
                       "cache_drop": r.drop_method, "samples": r.samples,
                       "by_streams": r.by_streams, "ratios": r.ratios(),
                       "ratios_by_streams": r.ratios_by_streams()}, f, indent=1)


if __name__ == "__main__":
    main()
