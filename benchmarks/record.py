"""Commit-record cost at many tensors: encode, decode, whole save and load, and
``dcp-plus inspect --json``, against a 1-tensor checkpoint.

    python -m benchmarks.record                       # 100,000 tensors of 8 floats
    python -m benchmarks.record --tensors 10000 --repeat 5 --json out.json

One process (``no_dist``), ``LocalWriter`` + ``CachedSavePlanner``. Encode and decode time
``encode_record`` / ``decode_record`` on the saved record (version 4, columnar, above 1,000
items) and, for comparison, on the same metadata in the row form (version 2) that every
record used before; the figures are the median (min) of ``--repeat`` runs. ``inspect`` runs
the command in a fresh interpreter (import time included, as a user sees it) on both
checkpoints; the difference is what the tensors cost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import dcp_plus.format.record as record_module
from dcp_plus import CachedSavePlanner, LocalReader, LocalWriter, SafeLoadPlanner
from dcp_plus.format.record import decode_record, encode_record


def state(n: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((8,), float(i)) for i in range(n)}


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return {"median_s": statistics.median(runs), "min_s": min(runs)}


def save_load(n: int, path: Path) -> dict[str, float]:
    sd = state(n)
    t = time.perf_counter()
    dcp.save(sd, storage_writer=LocalWriter(path), planner=CachedSavePlanner(), no_dist=True)
    saved = time.perf_counter() - t
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    t = time.perf_counter()
    dcp.load(target, storage_reader=LocalReader(path), planner=SafeLoadPlanner(), no_dist=True)
    loaded = time.perf_counter() - t
    assert all(torch.equal(target[k], v) for k, v in sd.items()), "not bit-exact"
    return {"save_s": saved, "load_s": loaded}


def inspect_s(path: Path, repeat: int) -> float:
    cmd = [sys.executable, "-m", "dcp_plus", "inspect", "--json", str(path)]
    return timed(lambda: subprocess.run(cmd, check=True, capture_output=True), repeat)["min_s"]


def run(n: int, repeat: int, root: Path) -> dict[str, Any]:
    big, one = root / "big", root / "one"
    out: dict[str, Any] = {"tensors": n, "save_load": save_load(n, big)}
    save_load(1, one)
    data = (big / ".metadata").read_bytes()
    md = decode_record(data, "big")
    out["record_bytes"] = len(data)
    out["encode"] = timed(lambda: encode_record(md, md.storage_data), repeat)
    out["decode"] = timed(lambda: decode_record(data, "big"), repeat)
    saved = record_module.COLUMNAR_MIN_ITEMS
    record_module.COLUMNAR_MIN_ITEMS = n + 1  # the row form, as before version 4
    try:
        rows = encode_record(md, md.storage_data)
        out["row_form"] = {"record_bytes": len(rows),
                           "encode": timed(lambda: encode_record(md, md.storage_data), repeat),
                           "decode": timed(lambda: decode_record(rows, "rows"), repeat)}
    finally:
        record_module.COLUMNAR_MIN_ITEMS = saved
    out["inspect_json_s"] = {"tensors": inspect_s(big, repeat), "one": inspect_s(one, repeat)}
    out["inspect_json_s"]["extra"] = out["inspect_json_s"]["tensors"] - out["inspect_json_s"]["one"]
    return out


def report(r: dict[str, Any]) -> str:
    rf = r["row_form"]
    sl, ins = r["save_load"], r["inspect_json_s"]
    return "\n".join([
        f"{r['tensors']:,} tensors of 8 float32 (one process, LocalWriter + CachedSavePlanner)",
        "| | columnar (v4) | row form (v2) |", "|---|---|---|",
        f"| record bytes | {r['record_bytes']:,} | {rf['record_bytes']:,} |",
        f"| encode_record, median (min) | {r['encode']['median_s']:.3f} s "
        f"({r['encode']['min_s']:.3f}) | {rf['encode']['median_s']:.3f} s "
        f"({rf['encode']['min_s']:.3f}) |",
        f"| decode_record, median (min) | {r['decode']['median_s']:.3f} s "
        f"({r['decode']['min_s']:.3f}) | {rf['decode']['median_s']:.3f} s "
        f"({rf['decode']['min_s']:.3f}) |",
        f"save {sl['save_s']:.2f} s, load {sl['load_s']:.2f} s (bit-exact); "
        f"inspect --json {ins['tensors']:.2f} s vs {ins['one']:.2f} s for 1 tensor "
        f"(+{ins['extra']:.2f} s)",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(tempfile.mkdtemp(prefix="dcpp-bench-record-"))
    try:
        result = run(args.tensors, args.repeat, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
