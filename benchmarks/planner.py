"""Plan-step time, whole-save time and collective bytes: DCP's planners vs CachedSavePlanner.

    python -m benchmarks.planner                      # the full matrix (long: split it, below)
    python -m benchmarks.planner --ranks 2 --tensors 3000 --placements shard --json a.json
    python -m benchmarks.planner --report a.json b.json ...   # one set of tables from several runs
    python -m benchmarks.planner --quick              # 2 ranks x 3,000 mixed DTensors, 4 saves

Matrix: ranks (2, 4) x tensors (3,000, 10,000) x placement (``Replicate()``, ``Shard(0)``) x
saves 1..10, each configuration in its own spawned gloo world on 127.0.0.1. The state dict is
``{"model": {...}}`` of small float32 DTensors (global shape ``(2 * ranks, 4)``). Planners,
interleaved save by save so that load drift hits all alike:

* ``dcp_default``: ``DefaultSavePlanner()``
* ``dcp_cached``: ``DefaultSavePlanner(enable_plan_caching=True)`` (DCP's own plan cache)
* ``cached_save``: ``CachedSavePlanner()``
* ``cached_save_local``: ``CachedSavePlanner()`` with dcp_plus's ``LocalWriter`` (an extra row)
* ``dcp_cached_local``: DCP's cached planner with ``LocalWriter``: the planner alone compared
* ``exchange``: no save, only the two object collectives of DCP's plan step with a hit-sized
  payload, timed like a plan step: the floor under any planner on this machine

The first three write with a stock ``FileSystemWriter(sync_files=False)`` (like for like);
the last with ``LocalWriter(fsync=False)``, whose write-result gather is O(1) per rank.

Before every save each rank runs ``gc.collect()`` and then a ``dist.barrier()`` (``--sync``),
outside the timed region: all ranks start the save together, and no planner pays for garbage
or a straggling rank left by the previous planner's save. Per save, per rank:

* plan step: from ``set_up_planner`` entry to ``finish_plan`` exit, i.e. flatten and
  fingerprint, local plan, the plan gather, the coordinator's global plan, the plan scatter
  and the final plan (everything DCP does before ``write_data``);
* whole save: ``dcp.save`` wall time;
* bytes: the largest pickled payload the rank puts into each of DCP's four object collectives
  (plan gather, plan scatter, write-result gather, metadata broadcast).

``--pin-cpus`` binds each rank (all its threads) to CPU ``rank % cpus``, as a launcher
binds ranks to their own cores. On a host with fewer cores than threads this changes where a
collective's wakeups run: unpinned, the scheduler wakes a waiting rank's gloo threads on the
core where the coordinator already writes, and the last plan-scatter receive then waits out
the writer's time slice (2-4 ms on the 2-core dev VM, seen in per-phase timestamps).

A save's figure is its slowest rank's. Reported: the first save, and the median (min-max) of
saves 2..N; ratios are CachedSavePlanner's medians over DCP's cached planner's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import itertools
import json
import logging
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_plus.cli.bench.machine import ForeignCpu, load1, machine
from dcp_plus.planners.cached_save import CachedSavePlanner
from dcp_plus.writers import LocalWriter
from tools.testkit.collectives import CollectiveBytes, save_phases
from tools.testkit.world import run_ranks

log = logging.getLogger("benchmarks.planner")

PLANNERS = ("dcp_default", "dcp_cached", "dcp_cached_local", "cached_save", "cached_save_local",
            "exchange")
LABELS = {
    "dcp_default": "DefaultSavePlanner",
    "dcp_cached": "DefaultSavePlanner(enable_plan_caching=True)",
    "cached_save": "CachedSavePlanner",
    "dcp_cached_local": "DefaultSavePlanner(enable_plan_caching=True) + LocalWriter",
    "cached_save_local": "CachedSavePlanner + LocalWriter",
    "exchange": "floor: DCP's plan exchange alone",
}
EXCHANGE_BYTES = 162
"""Payload of the ``exchange`` row: what a CachedSavePlanner hit sends in the plan gather."""
PHASES = ("plan_gather", "plan_scatter", "write_gather", "metadata_broadcast")
PLAN_TARGET = 0.1
SAVE_TARGET = 0.5


class _Timed:
    """Mixin recording the plan step of the last save in ``plan_s``."""

    _t0 = 0.0
    plan_s = 0.0

    # DCP's own parameter names: given ``*args``, DCP would call the old two-argument form,
    # passing ``is_coordinator`` as ``storage_meta`` (and no writer's ``storage_meta``).
    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self._t0 = time.perf_counter()
        super().set_up_planner(state_dict, storage_meta, is_coordinator)  # type: ignore[misc]

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)  # type: ignore[misc]
        self.plan_s = time.perf_counter() - self._t0
        return plan


def make_planner(name: str, tag: str) -> Any:
    """A timed planner; DCP's cache is keyed by class name, so each run gets its own class."""
    if name == "exchange":
        return None
    if name == "dcp_default":
        return type(f"TimedDefault_{tag}", (_Timed, DefaultSavePlanner), {})()
    if name in ("dcp_cached", "dcp_cached_local"):
        return type(f"TimedDcpCached_{name}_{tag}", (_Timed, DefaultSavePlanner), {})(
            enable_plan_caching=True
        )
    return type(f"TimedCached_{tag}", (_Timed, CachedSavePlanner), {})()


def make_writer(name: str, path: str) -> Any:
    """The storage writer a planner's row uses."""
    if name.endswith("_local"):
        return LocalWriter(path, fsync=False)
    return FileSystemWriter(path, sync_files=False)


def state_dict(n: int, world: int, placement: str = "mixed") -> dict[str, Any]:
    """``n`` small DTensors, ``Replicate()``, ``Shard(0)`` or alternating (``mixed``); or
    (``distinct``) ``n`` plain tensors of 8 floats per rank, each rank's its own (as FSDP
    shards are)."""
    if placement == "distinct":
        rank = dist.get_rank()
        return {"model": {f"r{rank}.layers.{i // 8}.w{i % 8}": torch.full((8,), float(i))
                          for i in range(n)}}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, Any] = {}
    for i in range(n):
        t = torch.full((2 * world, 4), float(i))
        if placement == "replicate" or (placement == "mixed" and i % 2):
            p: Any = Replicate()
        else:
            p = Shard(0)
        sd[f"layers.{i // 8}.w{i % 8}"] = distribute_tensor(t, mesh, [p])
    return {"model": sd}


def plan_exchange(rank: int, world: int) -> float:
    """Seconds for the collectives of DCP's plan step alone (``_DistWrapper.reduce_scatter``:
    ``gather_object`` to rank 0, then ``scatter_object_list``) with a hit-sized payload, in
    the same place of the loop as a save: the floor under any planner's plan step."""
    payload = b"x" * (EXCHANGE_BYTES - len(pickle.dumps(b"")))  # pickled: EXCHANGE_BYTES
    t0 = time.perf_counter()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    reply: list[Any] = [None]
    dist.scatter_object_list(reply, [payload] * world if rank == 0 else None, src=0)
    return time.perf_counter() - t0


def pin_to_cpu(cpu: int) -> None:
    """Bind every thread of this process (gloo's included) and those it starts to ``cpu``."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), {cpu})


def _worker(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    if cfg.get("pin"):
        cpus = sorted(os.sched_getaffinity(0))
        pin_to_cpu(cpus[rank % len(cpus)])
    sd = state_dict(cfg["tensors"], world, cfg["placement"])
    counter = CollectiveBytes()
    tag = f"{world}_{cfg['tensors']}_{cfg['placement']}"
    planners = {name: make_planner(name, tag) for name in cfg["planners"]}
    out: dict[str, Any] = {name: [] for name in planners}
    profiles = {n: cProfile.Profile() for n in ("cached_save", "cached_save_local")
                if cfg["profile"] and n in planners}
    with counter.count():
        # Interleaved (save i of every planner, then save i+1) so load drift hits all alike.
        for i in range(cfg["saves"]):
            for name, planner in planners.items():
                if cfg["sync"] == "barrier-gc":
                    gc.collect()
                if cfg["sync"] != "none":
                    dist.barrier()
                counter.take()
                prof = profiles.get(name) if i > 0 else None
                if prof is not None:
                    prof.enable()
                if planner is None:
                    s = plan_exchange(rank, world)
                    out[name].append({"plan_s": s, "save_s": s, "hit": None,
                                      "bytes": save_phases(counter.take())})
                    continue
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=make_writer(name, f"{root}/{name}_{i}"),
                         planner=planner)
                save_s = time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                out[name].append({"plan_s": planner.plan_s, "save_s": save_s,
                                  "hit": getattr(planner, "last_was_hit", None),
                                  "bytes": save_phases(counter.take())})
            dist.barrier()  # then drop this round's checkpoints (untimed): bounded disk use
            if rank == 0:
                for name in planners:
                    shutil.rmtree(f"{root}/{name}_{i}", ignore_errors=True)
    for n, prof in profiles.items():
        prof.dump_stats(os.path.join(cfg["profile"], f"{n}_{tag}_rank{rank}.prof"))
    return out


def run_world(cfg: dict[str, Any], worker: Any, timeout: float
              ) -> tuple[list[Any], float, float, ForeignCpu]:
    """``worker(rank, cfg, root)`` on ``cfg["ranks"]`` gloo ranks in a temporary root: each
    rank's result, the wall time, the load before, and the CPU other processes took."""
    with tempfile.TemporaryDirectory(dir=cfg.get("dir")) as root:
        load_before = load1()
        t0 = time.perf_counter()
        with ForeignCpu() as fc:
            per_rank = run_ranks(cfg["ranks"], worker, cfg, root, timeout=timeout)
        wall = time.perf_counter() - t0
    return per_rank, wall, load_before, fc


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration in one gloo world: per planner and save, the slowest rank's figures."""
    per_rank, wall, load_before, fc = run_world(cfg, _worker, timeout=1800)
    merged: dict[str, list[dict[str, Any]]] = {}
    for name in cfg["planners"]:
        merged[name] = []
        for i in range(cfg["saves"]):
            rows = [r[name][i] for r in per_rank]
            merged[name].append({
                "plan_s": max(r["plan_s"] for r in rows),
                "save_s": max(r["save_s"] for r in rows),
                "plan_s_ranks": [r["plan_s"] for r in rows],
                "save_s_ranks": [r["save_s"] for r in rows],
                "hit": rows[0]["hit"],
                "bytes": {k: max(r["bytes"].get(k, 0) for r in rows) for k in PHASES},
            })
    return {**{k: v for k, v in cfg.items() if k != "profile"},
            "load_before": round(load_before, 2), "load_after": round(load1(), 2),
            "foreign_cores": None if fc.cores is None else round(fc.cores, 2),
            "wall_s": round(wall, 1), "results": merged}


# ------------------------------------------------------------------------------ report


def _med(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    later = [r[key] for r in rows[1:]] or [r[key] for r in rows]
    return statistics.median(later), min(later), max(later)


def _ms(v: tuple[float, float, float]) -> str:
    return f"{v[0] * 1e3:.1f} ({v[1] * 1e3:.1f}–{v[2] * 1e3:.1f})"


def _s(v: tuple[float, float, float]) -> str:
    return f"{v[0]:.3f} ({v[1]:.3f}–{v[2]:.3f})"


def _pinned(c: dict[str, Any]) -> str:
    """The label suffix of a configuration run with ``--pin-cpus``."""
    return ", pinned" if c.get("pin") else ""


def _cfg_name(c: dict[str, Any]) -> str:
    return f"{c['ranks']} x {c['tensors']:,} {c['placement']}{_pinned(c)}"


def _order(c: dict[str, Any]) -> tuple[Any, ...]:
    return (c["ranks"], c["tensors"], c["placement"], _pinned(c))


def merge(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per configuration: planners of the same configuration run separately
    (e.g. DCP's default planner alone, where the full interleaved set is too long for one
    run) are put together."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for c in configs:
        m = out.get(_order(c))
        if m is None:
            out[_order(c)] = {**c, "results": dict(c["results"])}
            continue
        m["results"].update(c["results"])
        m["load_before"] = min(m["load_before"], c["load_before"])
        m["load_after"] = max(m["load_after"], c["load_after"])
        cores = [x for x in (m["foreign_cores"], c["foreign_cores"]) if x is not None]
        m["foreign_cores"] = max(cores) if cores else None
    return sorted(out.values(), key=_order)


def report(configs: list[dict[str, Any]]) -> list[str]:
    """Markdown tables: per planner, criteria (ratios), hit bytes vs tensor count."""
    configs = merge(configs)
    lines = ["### Per planner", "",
             "Plan step in ms, whole save in s: save 1 (a miss for every planner), then the "
             "median (min–max) of saves 2..N. Bytes: the largest payload one rank put into "
             "the collective in any of saves 2..N.", "",
             "| config | planner | hits 2..N | plan 1st | plan 2..N | save 1st | save 2..N "
             "| plan gather B | plan scatter B | write gather B | md bcast B |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        for name, rows in sorted(c["results"].items(), key=lambda kv: PLANNERS.index(kv[0])):
            hits = [r["hit"] for r in rows[1:]]
            hit_s = "–" if any(h is None for h in hits) else f"{sum(hits)}/{len(hits)}"
            b = {k: max(r["bytes"][k] for r in (rows[1:] or rows)) for k in PHASES}
            lines.append(
                f"| {_cfg_name(c)} | {LABELS[name]} | {hit_s} | {rows[0]['plan_s'] * 1e3:.1f} "
                f"| {_ms(_med(rows, 'plan_s'))} | {rows[0]['save_s']:.3f} "
                f"| {_s(_med(rows, 'save_s'))} | "
                + " | ".join(f"{b[k]:,}" for k in PHASES) + " |")
    lines += ["", "### Criteria (saves 2..N, medians)", "",
              f"Targets: plan step <= {PLAN_TARGET}x and whole save <= {SAVE_TARGET}x "
              "DCP's cached planner, both with the stock `FileSystemWriter`.", "",
              "| config | load avg | other procs (cores) | plan: ours / DCP cached "
              "| plan: floor / DCP cached | save: ours / DCP cached "
              "| plan: ours / DCP default | save: ours / DCP default "
              "| save: ours + LocalWriter / DCP cached | save, both on LocalWriter: ours / "
              "DCP cached |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        r = c["results"]
        if "cached_save" not in r or "dcp_cached" not in r:
            continue
        ours = {k: _med(r["cached_save"], k)[0] for k in ("plan_s", "save_s")}

        def ratio(ref: str, key: str, target: float | None = None,
                  mine: dict[str, float] = ours, r: dict[str, Any] = r) -> str:
            if ref not in r:
                return "–"
            x = mine[key] / _med(r[ref], key)[0]
            mark = "" if target is None else (" ✓" if x <= target else " ✗")
            return f"{x:.3f}x{mark}"
        floor = "–"
        if "exchange" in r:
            floor = ratio("dcp_cached", "plan_s", mine={"plan_s": _med(r["exchange"], "plan_s")[0]})
        local = "– | –"
        if "cached_save_local" in r:
            mine = {"save_s": _med(r["cached_save_local"], "save_s")[0]}
            local = ratio("dcp_cached", "save_s", mine=mine)
            local += " | " + ratio("dcp_cached_local", "save_s", mine=mine)
        lines.append(
            f"| {_cfg_name(c)} | {c['load_before']:.2f}–{c['load_after']:.2f} "
            f"| {'?' if c['foreign_cores'] is None else format(c['foreign_cores'], '.2f')} "
            f"| {ratio('dcp_cached', 'plan_s', PLAN_TARGET)} | {floor} "
            f"| {ratio('dcp_cached', 'save_s', SAVE_TARGET)} "
            f"| {ratio('dcp_default', 'plan_s')} | {ratio('dcp_default', 'save_s')} | {local} |")
    groups: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
    for c in configs:
        groups.setdefault((c["ranks"], c["placement"], _pinned(c)), {})[c["tensors"]] = c
    grown = [(k, v) for k, v in groups.items() if len(v) > 1]
    if grown:
        lines += ["", "### Collective bytes on a hit vs tensor count (largest payload, "
                  "saves 2..N)", "",
                  "| ranks, placement | planner | " + " | ".join(PHASES) + " |",
                  "|---|---|" + "---|" * len(PHASES)]
        for (ranks, placement, pinned), by_n in grown:
            ns = sorted(by_n)
            for name in PLANNERS:
                if not all(name in by_n[n]["results"] for n in ns):
                    continue
                cells = []
                for k in PHASES:
                    vals = [max(x["bytes"][k] for x in by_n[n]["results"][name][1:])
                            for n in ns]
                    cells.append(" / ".join(f"{v:,}" for v in vals))
                lines.append(f"| {ranks}, {placement}{pinned} ({' / '.join(f'{n:,}' for n in ns)} "
                             f"tensors) | {LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


def add_run_outputs(parser: argparse.ArgumentParser, profiled: str) -> None:
    """``--dir``, ``--profile`` (of ``profiled``), ``--json`` and ``--report``."""
    parser.add_argument("--dir", help="parent of the temporary checkpoint directories")
    parser.add_argument("--profile", metavar="DIR",
                        help=f"cProfile {profiled} into DIR (the timings of such a run are "
                             "not representative)")
    parser.add_argument("--json", help="write the raw figures of this run to this file")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="only print the tables of earlier runs' JSON files")


def load_configs(paths: list[str]) -> list[dict[str, Any]]:
    """The configurations of earlier runs' ``--json`` files, in order."""
    configs: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            configs += json.load(f)["configs"]
    return configs


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (or render runs' JSON) and print Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensors", type=int, nargs="+", default=[3000, 10000])
    parser.add_argument("--placements", nargs="+", default=["replicate", "shard"],
                        choices=["replicate", "shard", "mixed", "distinct"])
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--planners", nargs="+", default=list(PLANNERS), choices=PLANNERS)
    parser.add_argument("--sync", default="barrier-gc", choices=["barrier-gc", "barrier", "none"],
                        help="before each save: gc.collect() and a barrier (default), a "
                             "barrier only, or nothing")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="bind rank r to CPU r %% cpus (see the module docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="2 ranks x 3,000 mixed DTensors, 4 saves")
    add_run_outputs(parser, "CachedSavePlanner's saves 2..N per rank")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.report:
        print("\n".join(report(load_configs(args.report))))
        return
    if args.quick:
        args.ranks, args.tensors, args.placements, args.saves = [2], [3000], ["mixed"], 4
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    run_info = {"machine": machine(), "argv": sys.argv[1:] if argv is None else argv,
                "sync": args.sync, "started": datetime.datetime.now(datetime.timezone.utc)
                .isoformat(timespec="seconds")}
    configs = []
    for ranks, n, placement in itertools.product(args.ranks, args.tensors, args.placements):
        cfg = {"ranks": ranks, "tensors": n, "placement": placement, "saves": args.saves,
               "planners": args.planners, "sync": args.sync, "dir": args.dir,
               "profile": args.profile, "pin": args.pin_cpus}
        log.info("%s: %d saves x %d planners ...", _cfg_name(cfg), args.saves,
                 len(args.planners))
        res = run(cfg)
        configs.append(res)
        log.info("  %.0f s, load %.2f -> %.2f, other processes %s cores", res["wall_s"],
                 res["load_before"], res["load_after"], res["foreign_cores"])
        if args.json:  # after every configuration, so an interrupted run keeps what it has
            with open(args.json, "w") as f:
                json.dump({**run_info, "configs": configs}, f, indent=1)
    print("\n".join(report(configs)))


if __name__ == "__main__":
    main()
