"""What a verified O_DIRECT load into torch's tensors costs beyond the device, and why.

    python -m benchmarks.load_floor [--size-gib 2] [--rounds 5] [--dir /var/tmp] [--json F]

dcp_plus files keep every extent 4 KiB-aligned (DESIGN §4), and ``O_DIRECT`` lands a 4 KiB
file block only at a 4 KiB-aligned address; torch's CPU tensors start 64 bytes (or any
multiple of 64) into a page. So a load reads each tensor's body at the tensor's first 4 KiB
boundary and moves it down into place, and hashes it on the way: one more pass over the
state's memory than the device's own transfer. Each round, in one process, from a dropped page cache
(order reversed every other round):

read limit        the checkpoint's files read with O_DIRECT by 4 threads into four reused
                  huge-page buffers (``direct_read``; 4 streams are the best count here)
into torch memory the same 16 MiB requests, 4 in flight (6 threads), into one torch tensor of
                  the state's size, at 4 KiB-aligned places: the device into memory of the
                  state's kind
+ move + hash     the same, each request landing at the 4 KiB boundary after a place that
                  starts 64 bytes into a page (4,032 bytes past it) and moved down, a MiB at
                  a time, each MiB hashed after its move (what
                  ``LocalReader`` does per tensor): the floor of any verified O_DIRECT load
                  into unaligned memory of 4 KiB-aligned extents
verified load     ``dcp.load`` of the state (zeroed first) with ``LocalReader`` and
                  ``SafeLoadPlanner``: torch's own tensors
verified load, aligned   the same into a copy of the state whose every tensor starts at a
                  4 KiB boundary: nothing to move, the reads land in place

Every load is checked bit-exact against the state's checksums afterwards. The ratios are each
case over the same round's read limit, and the verified load over its floor; medians over
rounds. Two verified loads differ only in their destinations' alignment, so their ratio is what
file offsets congruent to the destinations' (DESIGN §4 as proposed) would win here.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from argparse import Namespace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.direct_rounds import round_args
from benchmarks.save_load import data_files
from dcp_plus.cli.bench.limits import direct_read, ring_buffers
from dcp_plus.cli.bench.machine import drop_caches, machine
from dcp_plus.cli.bench.models import gpt2_like_state_dict, iter_tensors, map_tensors
from dcp_plus.format.checksum import checksum_bytes, new_hasher
from dcp_plus.format.values import byte_view
from dcp_plus.planners import CachedSavePlanner, SafeLoadPlanner
from dcp_plus.readers import LocalReader
from dcp_plus.storage.direct_read import O_DIRECT, copy_bytes
from dcp_plus.writers import LocalWriter

PAGE = 4096
REQUEST = 16 << 20  # LocalReader's longest request (direct_extents.PIECE)
STEP = 1 << 20  # its move-and-hash step (direct_extents.HASH_STEP)
TORCH_OFFSET = 64  # where torch's large CPU tensors start in their first page
CASES = ("read limit", "into torch memory", "+ move + hash", "verified load",
         "verified load, aligned")


def aligned_copy(sd: Any) -> tuple[Any, torch.Tensor]:
    """``sd`` with every tensor replaced by a zeroed one of its shape and dtype that starts at
    a 4 KiB boundary of one buffer (returned too: it owns the memory); other values kept."""
    tensors = [t for _, t in iter_tensors(sd)]
    need = sum(-(-t.numel() * t.element_size() // PAGE) * PAGE for t in tensors) + PAGE
    arena = torch.zeros(need, dtype=torch.uint8)
    at = -arena.data_ptr() % PAGE

    def carve(t: torch.Tensor) -> torch.Tensor:
        nonlocal at
        n = t.numel() * t.element_size()
        view = arena[at:at + n].view(t.dtype).view(t.shape)
        at += -(-n // PAGE) * PAGE
        return view

    return map_tensors(sd, carve), arena


def requests_of(files: list[str]) -> list[tuple[str, int, int]]:
    """``(file, offset, length)``: each file in ``REQUEST``-sized reads, rounded up to 4 KiB."""
    out = []
    for f in files:
        size = os.path.getsize(f)
        out += [(f, o, -(-min(REQUEST, size - o) // PAGE) * PAGE) for o in range(0, size, REQUEST)]
    return out


def floor_read(reqs: list[tuple[str, int, int]], memory: torch.Tensor, move: bool,
               streams: int = 4, copiers: int = 2) -> None:
    """``reqs`` read with O_DIRECT, ``streams`` at a time on ``streams + copiers`` threads,
    request ``i`` into its own slot of ``memory``; with ``move``, read at the 4 KiB boundary
    after a place ``TORCH_OFFSET`` bytes into a page and moved down to it a ``STEP`` at a
    time, each hashed."""
    mem = byte_view(memory)
    start = memory.data_ptr()
    base = start + (-start % PAGE)
    slot = REQUEST + 2 * PAGE
    fds = {f: os.open(f, os.O_RDONLY | O_DIRECT) for f in {r[0] for r in reqs}}
    todo = iter(enumerate(reqs))
    lock, reading = threading.Lock(), threading.Semaphore(streams)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while not errors:
                with lock:
                    i, (f, off, n) = next(todo, (-1, ("", 0, 0)))
                if i < 0:
                    return
                land = base + i * slot + (PAGE if move else 0)
                with reading:
                    got = os.preadv(fds[f], [mem[land - start:land - start + n]], off)
                if got < n and got < os.fstat(fds[f]).st_size - off:
                    raise EOFError(f"{f}: {got} bytes at {off}, short of the file")
                if move:
                    dst, hasher = base + i * slot + TORCH_OFFSET, new_hasher()
                    for s in range(0, n, STEP):
                        m = min(STEP, n - s)
                        copy_bytes(dst + s, land + s, m)
                        hasher.update(mem[dst - start + s:dst - start + s + m])
        except BaseException as e:  # raised by the caller
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(streams + copiers)]
    try:
        for t in threads:
            t.start()
    finally:
        for t in threads:
            t.join()
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]


def checksums(sd: Any) -> list[str]:
    """Every tensor's checksum, in ``iter_tensors`` order."""
    return [checksum_bytes(byte_view(t)) for _, t in iter_tensors(sd)]


def zero(sd: Any) -> None:
    """Zero every tensor of ``sd`` (a load must then fill them all)."""
    for _, t in iter_tensors(sd):
        t.zero_()


def run(args: Namespace) -> dict[str, list[float]]:
    """Every case of every round, in seconds."""
    sd = gpt2_like_state_dict(size_gib=args.size_gib)
    want = checksums(sd)
    aligned, _arena = aligned_copy(sd)
    root = tempfile.mkdtemp(prefix="dcpp-floor-", dir=args.dir)
    try:
        ckpt = os.path.join(root, "ckpt")
        dcp.save(sd, storage_writer=LocalWriter(ckpt), planner=CachedSavePlanner(),
                 no_dist=True)
        files = data_files(ckpt)
        reqs = requests_of(files)
        memory = torch.zeros(len(reqs) * (REQUEST + 2 * PAGE) + PAGE, dtype=torch.uint8)
        rings = ring_buffers(4)

        def load(into: Any) -> None:
            dcp.load(into, storage_reader=LocalReader(ckpt), planner=SafeLoadPlanner(),
                     no_dist=True)

        cases = {"read limit": lambda: direct_read(files, 4, None, rings),
                 "into torch memory": lambda: floor_read(reqs, memory, move=False),
                 "+ move + hash": lambda: floor_read(reqs, memory, move=True),
                 "verified load": lambda: load(sd),
                 "verified load, aligned": lambda: load(aligned)}
        samples: dict[str, list[float]] = {c: [] for c in CASES}
        for i in range(args.rounds):
            for case in CASES[::-1] if i % 2 else CASES:
                if case.startswith("verified"):
                    zero(aligned if case.endswith("aligned") else sd)
                drop_caches([root])
                time.sleep(args.settle)
                t = time.perf_counter()
                cases[case]()
                samples[case].append(time.perf_counter() - t)
                if case.startswith("verified"):
                    got = checksums(aligned if case.endswith("aligned") else sd)
                    if got != want:
                        raise RuntimeError(f"{case}: the loaded state differs from the saved one")
            print(f"round {i + 1}: " + ", ".join(f"{c} {samples[c][-1]:.3f} s" for c in CASES),
                  flush=True)
        return samples
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ratios(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per round: each case over the read limit; the loads over the floor; aligned over not."""
    def over(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(samples[a], samples[b], strict=True)]
    out = {f"{c} / read limit": over(c, "read limit") for c in CASES[1:]}
    out["verified load / + move + hash"] = over("verified load", "+ move + hash")
    out["verified load, aligned / into torch memory"] = over("verified load, aligned",
                                                             "into torch memory")
    out["verified load / verified load, aligned"] = over("verified load",
                                                         "verified load, aligned")
    return out


def main(argv: list[str] | None = None) -> None:
    args = round_args(__doc__, argv, rounds=5, settle=1.0)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    samples = run(args)
    print("\n| case | median s (min-max) |\n|---|---|")
    for c in CASES:
        x = samples[c]
        print(f"| {c} | {statistics.median(x):.3f} ({min(x):.3f}-{max(x):.3f}) |")
    print("\n| ratio | median (min-max) |\n|---|---|")
    r = ratios(samples)
    for name, x in r.items():
        print(f"| {name} | **{statistics.median(x):.3f}x** ({min(x):.2f}-{max(x):.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine(), "samples": samples,
                       "ratios": r}, f, indent=1)


if __name__ == "__main__":
    main()
