"""A save's fixed costs against world size: DCP's planners vs CachedSavePlanner at 2-16 ranks.

    python -m benchmarks.scaling --ranks 2,4,8,16 --tensors 1000 --saves 5 --json s.json
    python -m benchmarks.scaling --report a.json b.json       # tables, fits and projection again

Each rank count runs in its own spawned gloo world on 127.0.0.1 (oversubscribed on a small
host: 16 ranks on 2 cores). Every rank saves its own ``--tensors`` plain tensors of 8 floats
(distinct per rank, as FSDP shards are), with every planner on the same writer
(``LocalWriter(fsync=False)``; ``--writer fs``: DCP's ``FileSystemWriter(sync_files=False)``),
interleaved save by save:

* ``dcp_default``: ``DefaultSavePlanner()``
* ``dcp_cached``: ``DefaultSavePlanner(enable_plan_caching=True)``
* ``cached_save``: ``CachedSavePlanner()``

Before every save each rank runs ``gc.collect()`` and a barrier (untimed). Per save:

* wall: ``dcp.save`` on the slowest rank (distorted by oversubscription: reported, not fitted);
* coordinator CPU: ``time.process_time()`` of rank 0 around ``dcp.save`` (all its threads):
  oversubscription delays it but does not add to it;
* bytes: per collective the largest pickled payload one rank put in (``per_rank_B``), and the
  bytes through the coordinator's link (``coord_B``: a gather's root receives ``ranks`` times
  the largest payload, as ``gather_object`` pads to it; a scatter's root sends each rank its
  share; a broadcast's root sends ``ranks - 1`` copies).

After the timed saves, one more save per planner (a hit for the caching ones) is measured for
memory on rank 0 (:mod:`benchmarks.scaling_memory`). :mod:`benchmarks.scaling_model` fits and
projects.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import logging
import os
import shutil
import sys
import time
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from benchmarks.planner import (
    add_run_outputs,
    load_configs,
    make_planner,
    run_world,
    state_dict,
)
from benchmarks.scaling_memory import held_by, measure_save
from benchmarks.scaling_model import DEFAULT_NET, Net, report
from dcp_plus.cli.bench.machine import load1, machine
from dcp_plus.writers import LocalWriter
from tools.testkit.collectives import CollectiveBytes, save_phases

log = logging.getLogger("benchmarks.scaling")

PLANNERS = ("dcp_default", "dcp_cached", "cached_save")
PHASES = ("plan_gather", "plan_scatter", "write_gather", "metadata_broadcast")


def make_writer(kind: str, path: str) -> Any:
    """The writer every planner of a run uses."""
    if kind == "fs":
        return FileSystemWriter(path, sync_files=False)
    return LocalWriter(path, fsync=False)


def coordinator_sends(events: list[tuple[str, list[int]]]) -> dict[str, int]:
    """Bytes the coordinator itself serialized into each scatter / broadcast of one save."""
    out: dict[str, int] = {}
    for name, sizes in events:
        if name == "scatter_object_list" and "plan_scatter" not in out:
            out["plan_scatter"] = sum(sizes)
        elif name == "broadcast_object_list" and "metadata_broadcast" not in out:
            out["metadata_broadcast"] = sum(sizes)
    return out


def _worker(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    sd = state_dict(cfg["tensors"], world, "distinct")
    counter = CollectiveBytes()
    planners = {name: make_planner(name, f"scaling{world}") for name in cfg["planners"]}
    out: dict[str, Any] = {name: [] for name in planners}
    profile = cProfile.Profile() if cfg.get("profile") and rank == 0 else None
    with counter.count():
        for i in range(cfg["saves"]):
            for name, planner in planners.items():
                gc.collect()
                dist.barrier()
                counter.take()
                prof = profile if name == "cached_save" and i > 0 else None
                if prof is not None:
                    prof.enable()
                c0, t0 = time.process_time(), time.perf_counter()
                dcp.save(sd, storage_writer=make_writer(cfg["writer"], f"{root}/{name}_{i}"),
                         planner=planner)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if prof is not None:
                    prof.disable()
                events = counter.take()
                out[name].append({"save_s": wall, "cpu_s": cpu, "plan_s": planner.plan_s,
                                  "hit": getattr(planner, "last_was_hit", None),
                                  "bytes": save_phases(events),
                                  "sends": coordinator_sends(events) if rank == 0 else {}})
            dist.barrier()  # then drop this round's checkpoints (untimed): bounded disk use
            if rank == 0:
                for name in planners:
                    shutil.rmtree(f"{root}/{name}_{i}", ignore_errors=True)
    if profile is not None:
        profile.dump_stats(os.path.join(cfg["profile"], f"cached_save_{world}_rank0.prof"))
    memory: dict[str, Any] = {}

    def writer(path: str) -> Any:
        return make_writer(cfg["writer"], path)

    for name, planner in planners.items():
        gc.collect()
        dist.barrier()

        def save(w: Any, p: Any = planner) -> None:
            dcp.save(sd, storage_writer=w, planner=p)

        memory[name] = measure_save(save, writer, f"{root}/{name}_mem", measured=rank == 0)
        memory[name]["hit"] = getattr(planner, "last_was_hit", None)
        if rank == 0:
            memory[name]["held_by_planner"] = held_by(planner)
    return {"saves": out, "memory": memory}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank count in one gloo world: per planner and save, the merged figures."""
    per_rank, wall, load_before, fc = run_world(cfg, _worker, timeout=3600)
    world = cfg["ranks"]
    results: dict[str, Any] = {}
    for name in cfg["planners"]:
        rows = []
        for i in range(cfg["saves"]):
            ranks = [r["saves"][name][i] for r in per_rank]
            per = {k: max(r["bytes"].get(k, 0) for r in ranks) for k in PHASES}
            sends = ranks[0]["sends"]
            coord = {"plan_gather": world * per["plan_gather"],
                     "plan_scatter": sends.get("plan_scatter", 0),
                     "write_gather": world * per["write_gather"],
                     "metadata_broadcast": (world - 1) * sends.get("metadata_broadcast", 0)}
            rows.append({"save_s": max(r["save_s"] for r in ranks),
                         "cpu_s": ranks[0]["cpu_s"], "plan_s": ranks[0]["plan_s"],
                         "hit": ranks[0]["hit"], "per_rank_B": per, "coord_B": coord})
        results[name] = {"saves": rows, "memory": per_rank[0]["memory"][name]}
    return {**{k: v for k, v in cfg.items() if k not in ("dir", "profile")},
            "load_before": round(load_before, 2), "load_after": round(load1(), 2),
            "foreign_cores": None if fc.cores is None else round(fc.cores, 2),
            "wall_s": round(wall, 1), "results": results}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (or render earlier JSON) and print Markdown tables, fits, projection."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=_ints, default=[2, 4, 8, 16], help="e.g. 2,4,8,16")
    parser.add_argument("--tensors", type=int, default=1000, help="distinct tensors per rank")
    parser.add_argument("--saves", type=int, default=5, help="saves per planner (1st: a miss)")
    parser.add_argument("--planners", type=lambda s: s.split(","), default=list(PLANNERS))
    parser.add_argument("--writer", choices=["local", "fs"], default="local")
    parser.add_argument("--latency-us", type=float, default=DEFAULT_NET.latency_us,
                        help="projection: one network hop's latency")
    parser.add_argument("--per-message-us", type=float, default=DEFAULT_NET.per_message_us,
                        help="projection: the coordinator's cost per message it handles")
    parser.add_argument("--bandwidth-gbs", type=float, default=DEFAULT_NET.bandwidth_gbs,
                        help="projection: the coordinator's link, GB/s")
    add_run_outputs(parser, "the coordinator's CachedSavePlanner saves 2..N")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    net = Net(args.latency_us, args.per_message_us, args.bandwidth_gbs)
    if args.report:
        print("\n".join(report(load_configs(args.report), net)))
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    for name in args.planners:
        if name not in PLANNERS:
            parser.error(f"--planners: {name!r} is not one of {', '.join(PLANNERS)}")
    info = {"machine": machine(), "argv": sys.argv[1:] if argv is None else argv,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    configs = []
    for ranks in args.ranks:
        cfg = {"ranks": ranks, "tensors": args.tensors, "saves": args.saves,
               "planners": args.planners, "writer": args.writer, "dir": args.dir,
               "profile": args.profile}
        log.info("%d ranks x %d tensors: %d saves x %d planners ...", ranks, args.tensors,
                 args.saves, len(args.planners))
        res = run(cfg)
        configs.append(res)
        log.info("  %.0f s, load %.2f -> %.2f", res["wall_s"], res["load_before"],
                 res["load_after"])
        if args.json:  # after every rank count, so an interrupted run keeps what it has
            with open(args.json, "w") as f:
                json.dump({**info, "configs": configs}, f, indent=1)
    print("\n".join(report(configs, net)))


if __name__ == "__main__":
    main()
