"""CachedSavePlanner in real gloo worlds: hits, O(1) collectives, replans, executors, FSDP2.

One 2-rank and one 4-rank world per module run every case (spawning costs ~5 s per process);
the pytest tests then assert on what each rank reported.
"""

from __future__ import annotations

import os
import pickle
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_plus.planners import cache as cache_module
from dcp_plus.planners.cached_save import CachedSavePlanner
from dcp_plus.readers import LocalReader
from dcp_plus.writers import LocalWriter
from tools.testkit.collectives import CollectiveBytes, save_phases
from tools.testkit.world import run_ranks

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- worker-side helpers


def _plain(n: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {"model": {f"p{i}": torch.full((8,), float(i), dtype=dtype) for i in range(n)},
            "step": 7}


def _dtensors(n: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd: dict[str, Any] = {}
    for i in range(n):
        t = torch.arange(4 * world * 2, dtype=torch.float32).reshape(4 * world, 2) + i
        sd[f"s{i}"] = distribute_tensor(t, mesh, [Shard(0)])
        sd[f"r{i}"] = distribute_tensor(t.clone(), mesh, [Replicate()])
    return {"model": sd}


def _record(path: str) -> Any:
    return FileSystemReader(path).read_metadata()


def _local_record(path: str) -> Any:
    return LocalReader(path).read_metadata()


def _stock_cached(tag: str) -> DefaultSavePlanner:
    # DCP's cache is keyed by class name: a fresh class keeps cases apart.
    cls = type(f"StockCached_{tag}", (DefaultSavePlanner,), {})
    return cls(enable_plan_caching=True)


def _saves(planner: Any, sd: dict[str, Any], root: str, tag: str, count: int,
           counter: CollectiveBytes, writer: Any = FileSystemWriter,
           **kw: Any) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        counter.take()
        dcp.save(sd, storage_writer=writer(f"{root}/{tag}_{i}"), planner=planner, **kw)
        out.append({"hit": getattr(planner, "last_was_hit", None),
                    "bytes": save_phases(counter.take())})
    return out


class RecordingPlanner(CachedSavePlanner):
    """Appends 'hit'/'miss' to a file on every save (observable from a PROCESS daemon)."""

    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.log_path = log_path

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        with open(self.log_path, "a") as f:
            f.write(("hit" if self.last_was_hit else "miss") + f" pid={os.getpid()}\n")
        return plan


# ---------------------------------------------------------------- cases


def _case_bytes(rank: int, world: int, root: str, counter: CollectiveBytes) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for n in (100, 1000):
        res[f"cached_plain_{n}"] = _saves(CachedSavePlanner(), _plain(n), root, f"cp{n}", 3,
                                          counter, writer=LocalWriter)
        res[f"stock_plain_{n}"] = _saves(_stock_cached(f"p{n}"), _plain(n), root, f"sp{n}", 3,
                                         counter)
        res[f"cached_dt_{n}"] = _saves(CachedSavePlanner(), _dtensors(n // 2, world), root,
                                       f"cd{n}", 3, counter, writer=LocalWriter)
        res[f"stock_writer_{n}"] = _saves(CachedSavePlanner(), _plain(n), root, f"sw{n}", 3,
                                          counter)
        res[f"local_plain_{n}"] = _saves(CachedSavePlanner(), _plain(n), root, f"lp{n}", 3,
                                         counter, writer=LocalWriter)
    return res


def _case_bit_exact(rank: int, world: int, root: str) -> bool:
    sd = _dtensors(20, world)
    sd["model"]["plain"] = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    planner = CachedSavePlanner()
    for i in range(3):
        for t in sd["model"].values():
            (t._local_tensor if hasattr(t, "_local_tensor") else t).add_(1.0)
        dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/be_{i}"), planner=planner)
    ok = planner.last_was_hit
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
    dcp.load(target, checkpoint_id=f"{root}/be_2")
    for k, v in sd["model"].items():
        a = target["model"][k]
        a, v = (a.to_local(), v.to_local()) if hasattr(v, "to_local") else (a, v)
        ok = ok and torch.equal(a, v)
    return bool(ok)


def _case_alternating(rank: int, world: int, root: str) -> list[bool]:
    full = _plain(30)
    full["optim"] = {f"m{i}": torch.zeros(8) for i in range(30)}
    model_only = {"model": full["model"]}
    planner = CachedSavePlanner(cache_size=2)
    hits = []
    for i in range(6):
        sd = full if i % 2 == 0 else model_only
        dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/alt_{i}"), planner=planner)
        hits.append(planner.last_was_hit)
    return hits


class _CommitPickles:
    """Stands in for ``pickle`` in ``dcp_plus.planners.cache``; counts dumps() by commit()."""

    def __init__(self) -> None:
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    def dumps(self, *args: Any, **kwargs: Any) -> bytes:
        if sys._getframe(1).f_code.co_name == "commit":
            self.count += 1
        return pickle.dumps(*args, **kwargs)


def _case_one_rank_changes(rank: int, world: int, root: str) -> dict[str, Any]:
    planner = CachedSavePlanner()
    sd = _plain(20)
    hits = []
    counting = _CommitPickles()
    cache_module.pickle = counting  # type: ignore[assignment]
    try:
        for i in range(4):
            if i == 2 and rank == world - 1:
                sd["model"]["extra"] = torch.ones(3)
            dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/one_{i}"), planner=planner)
            hits.append(planner.last_was_hit)
    finally:
        cache_module.pickle = pickle
    keys = sorted(_record(f"{root}/one_3").state_dict_metadata)
    cache = planner.cache
    structure = cache.finals.peek(cache.finals.keys()[-1])[1]  # type: ignore[index]  # latest
    held = {
        # the coordinator: every rank's local plan pickled, one structure Metadata per key
        "mirror_pickled": all(isinstance(m.peek(k), bytes)
                              for m in cache.mirror.values() for k in m.keys()),
        "mirror_ranks": sorted(cache.mirror),
        "one_metadata": all(cache.globals.peek(k).metadata is cache.finals.peek(k)[1]
                            for k in cache.globals.keys()),
        "structure_has_extra": "model.extra" in structure.state_dict_metadata,
        # the mirror holds the bytes DCP's gather received: commit() pickles no plan
        "commit_pickles": counting.count,
    }
    return {"hits": hits, "has_extra": "model.extra" in keys, "held": held}


def _case_dtype(rank: int, world: int, root: str) -> dict[str, list[str]]:
    out = {}
    for name, planner in (("cached", CachedSavePlanner()), ("stock", _stock_cached("dtype"))):
        sd = _plain(10)
        seen = []
        for i in range(4):
            if i == 2:
                sd["model"]["p0"] = sd["model"]["p0"].bfloat16()
            if i == 3:
                sd["model"]["p1"] = sd["model"]["p1"].reshape(2, 4)
            dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/dt_{name}_{i}"),
                     planner=planner)
            md = _record(f"{root}/dt_{name}_{i}").state_dict_metadata
            seen.append(f"{md['model.p0'].properties.dtype} {tuple(md['model.p1'].size)}")
        out[name] = seen[2:]
    return out


class _OtherWriter(FileSystemWriter):
    pass


def _case_writer_change(rank: int, world: int, root: str) -> list[bool]:
    planner = CachedSavePlanner()
    sd = _plain(10)
    writers = [FileSystemWriter(f"{root}/w_0"), FileSystemWriter(f"{root}/w_1"),
               FileSystemWriter(f"{root}/w_2", thread_count=2), _OtherWriter(f"{root}/w_3"),
               _OtherWriter(f"{root}/w_4")]
    hits = []
    for w in writers:
        planner.set_save_context(storage_writer=w)
        dcp.save(sd, storage_writer=w, planner=planner)
        hits.append(planner.last_was_hit)
    return hits


def _case_fsdp2(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    planner = CachedSavePlanner()
    hits = []
    for i in range(3):
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(f"{root}/fs_{i}"),
                 planner=planner)
        hits.append(planner.last_was_hit)
    expect = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{root}/fs_2")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = all(torch.equal(v.to_local(), expect[k]) for k, v in model.state_dict().items())
    return {"hits": hits, "restored": same, "replays": planner.cache.replays}


def _case_async(rank: int, world: int, root: str, counter: CollectiveBytes) -> dict[str, Any]:
    group = dist.new_group(backend="gloo")
    sd = _plain(200)
    planner = CachedSavePlanner()
    thread_hits, thread_bytes = [], []
    for i in range(3):
        counter.take()
        dcp.async_save(sd, storage_writer=LocalWriter(f"{root}/th_{i}"), planner=planner,
                       process_group=group).result()
        thread_hits.append(planner.last_was_hit)
        thread_bytes.append(save_phases(counter.take()))
    log_path = f"{root}/proc_{rank}.log"
    rec = RecordingPlanner(log_path)
    for i in range(3):
        fut = dcp.async_save(sd, storage_writer=FileSystemWriter(f"{root}/pr_{i}"), planner=rec,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        md = fut.result()
    keys = sorted(_record(f"{root}/pr_2").state_dict_metadata)
    local_log = f"{root}/proc_local_{rank}.log"
    rec_local, local_returned = RecordingPlanner(local_log), []
    for i in range(3):  # in the daemon: the broadcast carries the token, the pipe the Metadata
        fut = dcp.async_save(sd, storage_writer=LocalWriter(f"{root}/pl_{i}"), planner=rec_local,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        local_returned.append(len(fut.result().state_dict_metadata))
    with open(log_path) as f:
        lines = f.read().split()
    with open(local_log) as f:
        local_lines = f.read().split()
    return {"thread_hits": thread_hits, "thread_bytes": thread_bytes,
            "process": [w for w in lines if not w.startswith("pid=")],
            "process_local": [w for w in local_lines if not w.startswith("pid=")],
            "process_local_returned": local_returned,
            "process_local_keys_ok": sorted(_local_record(f"{root}/pl_2").state_dict_metadata)
            == keys,
            "process_keys_ok": keys == sorted(_local_record(f"{root}/th_2").state_dict_metadata),
            "process_returned": len(md.state_dict_metadata)}


def _world2(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    counter = CollectiveBytes()
    with counter.count():
        res = {"bytes": _case_bytes(rank, world, root, counter),
               "async": _case_async(rank, world, root, counter)}
    res["bit_exact"] = _case_bit_exact(rank, world, root)
    res["alternating"] = _case_alternating(rank, world, root)
    res["one_rank"] = _case_one_rank_changes(rank, world, root)
    res["dtype"] = _case_dtype(rank, world, root)
    res["writer"] = _case_writer_change(rank, world, root)
    res["fsdp2"] = _case_fsdp2(rank, world, root)
    return res


def _world4(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    counter = CollectiveBytes()
    res: dict[str, Any] = {}
    with counter.count():
        res["dt"] = _saves(CachedSavePlanner(), _dtensors(50, world), root, "dt4", 3, counter,
                           writer=LocalWriter)
    res["fsdp2"] = _case_fsdp2(rank, world, root)
    # Another world size with the same planner and state dict: a 2-rank subgroup, then back.
    sub = dist.new_group([0, 1], backend="gloo")
    planner, sd, hits = CachedSavePlanner(), _plain(40), []
    for i, group in enumerate([None, sub, None, sub]):
        if group is None or rank < 2:
            dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/ws_{i}"), planner=planner,
                     process_group=group)
            hits.append(planner.last_was_hit)
        dist.barrier()
    res["world_size"] = hits
    res["sub_record_ok"] = rank >= 2 or sorted(_record(f"{root}/ws_3").state_dict_metadata) == \
        sorted(f"model.p{i}" for i in range(40)) + ["step"]
    return res


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(2, _world2, str(tmp_path_factory.mktemp("w2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(4, _world4, str(tmp_path_factory.mktemp("w4")))


def _o1(phases: dict[str, int]) -> list[int]:
    return [phases["plan_gather"], phases["plan_scatter"], phases["metadata_broadcast"]]


def test_hit_collectives_carry_constant_bytes_independent_of_tensor_count(world2):
    for rank_res in world2:
        b = rank_res["bytes"]
        for kind in ("plain", "dt"):
            small, big = b[f"cached_{kind}_100"], b[f"cached_{kind}_1000"]
            assert [s["hit"] for s in small] == [False, True, True]
            assert [s["hit"] for s in big] == [False, True, True]
            for s, g in zip(small[1:], big[1:], strict=True):
                # equal up to the checkpoint path's length inside the broadcast token
                assert all(abs(x - y) <= 8 for x, y in zip(_o1(s["bytes"]), _o1(g["bytes"]),
                                                           strict=True)), (kind, s, g)
                assert max(_o1(g["bytes"])) < 1024
            # a miss carries the plans: 10x the tensors, several times the bytes
            assert big[0]["bytes"]["plan_gather"] > 5 * small[0]["bytes"]["plan_gather"]


def test_with_local_writer_every_collective_of_a_hit_is_constant_size(world2):
    # LocalWriter exchanges per-rank extent tables through storage, so the write-result
    # gather is O(1) too: all four collectives of a hit carry the same bytes at 100 and 1000
    for rank_res in world2:
        b = rank_res["bytes"]
        small, big = b["local_plain_100"], b["local_plain_1000"]
        assert [s["hit"] for s in big] == [False, True, True]
        for s, g in zip(small[1:], big[1:], strict=True):
            phases = ("plan_gather", "plan_scatter", "write_gather", "metadata_broadcast")
            assert all(abs(s["bytes"][k] - g["bytes"][k]) <= 16 for k in phases), (s, g)
            assert max(g["bytes"][k] for k in phases) < 1024, g


def test_stock_cached_planner_still_broadcasts_metadata_that_grows(world2):
    b = world2[0]["bytes"]
    small, big = b["stock_plain_100"][2]["bytes"], b["stock_plain_1000"][2]["bytes"]
    ours = b["cached_plain_1000"][2]["bytes"]
    assert big["metadata_broadcast"] > 5 * small["metadata_broadcast"]
    assert ours["metadata_broadcast"] * 50 < big["metadata_broadcast"]


def test_with_a_stock_writer_a_hit_broadcasts_the_stock_metadata(world2):
    # FileSystemWriter pickles the Metadata as its commit record: the planner never sends a
    # token then, so the broadcast is DCP's own; the plan exchange is O(1) all the same
    b = world2[0]["bytes"]
    for n in (100, 1000):
        ours, stock = b[f"stock_writer_{n}"], b[f"stock_plain_{n}"]
        assert [s["hit"] for s in ours] == [False, True, True]
        sent, full = ours[2]["bytes"], stock[2]["bytes"]
        assert abs(sent["metadata_broadcast"] - full["metadata_broadcast"]) < 0.01 * full[
            "metadata_broadcast"], (sent, full)  # up to the paths inside it
    small, big = b["stock_writer_100"][2]["bytes"], b["stock_writer_1000"][2]["bytes"]
    assert big["metadata_broadcast"] > 5 * small["metadata_broadcast"]
    assert abs(small["plan_gather"] - big["plan_gather"]) <= 8 and big["plan_gather"] < 1024


def test_dtensor_save_after_hits_loads_bit_exact(world2):
    assert all(r["bit_exact"] for r in world2)


def test_alternating_state_dicts_do_not_thrash(world2):
    for r in world2:
        assert r["alternating"] == [False, False, True, True, True, True]


def test_structure_change_on_one_rank_replans_on_all(world2):
    for r in world2:
        assert r["one_rank"]["hits"] == [False, True, False, True]
        assert r["one_rank"]["has_extra"]
        assert r["one_rank"]["held"]["structure_has_extra"]
    coordinator = world2[0]["one_rank"]["held"]
    assert coordinator["mirror_pickled"] and coordinator["mirror_ranks"] == [0, 1]
    assert coordinator["commit_pickles"] == 0
    assert coordinator["one_metadata"]


def test_dtype_and_shape_change_reach_the_record_where_stock_cache_keeps_float32(world2):
    for r in world2:
        assert r["dtype"]["cached"] == ["torch.bfloat16 (8,)", "torch.bfloat16 (2, 4)"]
        # the same check fails against DCP's own cache: it commits the stale float32
        assert r["dtype"]["stock"][0] == "torch.float32 (8,)"


def test_writer_type_or_settings_change_replans(world2):
    for r in world2:
        assert r["writer"] == [False, True, False, False, True]


def test_fsdp2_state_dict_hits_and_restores(world2, world4):
    for r in world2 + world4:
        # get_state_dict builds new dicts and new parameter DTensors: hits replay the flatten
        assert r["fsdp2"] == {"hits": [False, True, True], "restored": True, "replays": 2}


def test_thread_executor_hits_with_constant_bytes(world2):
    for r in world2:
        a = r["async"]
        assert a["thread_hits"] == [False, True, True]
        assert _o1(a["thread_bytes"][1]) == _o1(a["thread_bytes"][2])
        assert max(_o1(a["thread_bytes"][2])) < 1024


def test_process_executor_cache_survives_pickling_into_the_daemon(world2):
    for r in world2:
        a = r["async"]
        assert a["process"] == ["miss", "hit", "hit"]
        assert a["process_keys_ok"]
        assert a["process_returned"] == 201
        # a dcp_plus writer: the daemon's broadcast is the token, the pipe the full Metadata
        assert a["process_local"] == ["miss", "hit", "hit"]
        assert a["process_local_returned"] == [201, 201, 201]
        assert a["process_local_keys_ok"]


def test_four_ranks_dtensor_hits_with_constant_bytes(world4):
    for r in world4:
        assert [s["hit"] for s in r["dt"]] == [False, True, True]
        assert max(_o1(r["dt"][2]["bytes"])) < 1024


def test_another_world_size_replans_and_commits_the_live_structure(world4):
    for rank, r in enumerate(world4):
        expect = [False, False, True, True] if rank < 2 else [False, True]
        assert r["world_size"] == expect
        assert r["sub_record_ok"]
