"""ArenaStager with CUDA tensors: page-locked slabs, side-stream ordering, one registration per
slab, GPU-mode snapshots (``device_copy``), bit-exact round trips and no growth."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import CachedSavePlanner, LocalReader, LocalWriter, SafeLoadPlanner
from dcp_plus.stagers import ArenaStager
from tests.conftest import DTYPES, assert_bit_exact, free_port, load, random_tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_slabs_are_page_locked_with_one_registration_per_slab():
    sd = {f"w{i}": torch.randn(1024, device="cuda") for i in range(500)}
    with ArenaStager(slab_bytes=1 << 20) as stager:
        staged = stager.stage(sd).result()
        arena = stager._arenas[0]
        buf = arena.buffers[0]
        assert arena.pin and buf.pinned
        assert len(buf.slabs) < len(sd) // 10  # registrations are per slab, not per tensor
        assert all(v.is_pinned() for v in staged.values())
        for k, v in sd.items():
            assert staged[k].device.type == "cpu" and torch.equal(staged[k], v.cpu())
        del staged


def test_side_stream_waits_for_work_queued_on_the_compute_stream():
    x = torch.zeros(8 << 20, device="cuda")
    with ArenaStager() as stager:
        torch.cuda._sleep(200_000_000)  # keep the compute stream busy
        x.fill_(5.0)  # queued behind the sleep, before stage()
        staged = stager.stage({"x": x}).result()
        assert bool((staged["x"] == 5.0).all())
        assert all(s != torch.cuda.current_stream() for s in stager._engine.streams().values())
        del staged


def test_guard_makes_step_wait_for_the_device_to_host_copy():
    p = torch.nn.Parameter(torch.ones(4 << 20, device="cuda"))
    p.grad = torch.ones_like(p)
    opt = torch.optim.SGD([p], lr=1.0)
    with ArenaStager() as stager:
        stager.guard(opt)
        fut = stager.stage({"p": p})
        opt.step()
        staged = fut.result()
        assert bool((staged["p"] == 1.0).all())
        assert bool((p == 0.0).all())
        del staged, fut


# -- GPU mode (device_copy) and correctness on CUDA ----------------------------------------

MODES = ["never", "always"]


def _cuda_state_dict() -> dict:
    """Every dtype the format knows, 0-d, empty and non-contiguous tensors on the GPU, and
    CPU step counters as AdamW keeps them."""
    gen = torch.Generator().manual_seed(7)
    sd: dict = {}
    for i, dt in enumerate(DTYPES):
        sd[f"w{i}"] = random_tensor((513, 9), dt, gen).cuda()
        sd[f"s{i}"] = random_tensor((), dt, gen).cuda()
        if dt not in (torch.uint16, torch.float8_e4m3fn):  # barebones dtypes: few kernels
            sd[f"t{i}"] = random_tensor((9, 33), dt, gen).cuda().t()  # not contiguous
    sd["empty"] = torch.empty(0, 4, device="cuda")
    sd["step"] = torch.tensor(12.0)
    return sd


def _save(sd, path, stager):
    resp = dcp.async_save(sd, storage_writer=LocalWriter(path), planner=CachedSavePlanner(),
                          async_stager=stager, no_dist=True)
    stager.synchronize_staging()
    resp.upload_completion.result()


@pytest.mark.parametrize("mode", MODES)
def test_cuda_round_trip_is_bit_exact(mode, tmp_path):
    sd = _cuda_state_dict()
    expected = {k: v.cpu().clone() for k, v in sd.items()}
    with ArenaStager(device_copy=mode) as stager:
        _save(sd, tmp_path / "c", stager)
        used = stager.device_copy_status.last_device_copy_s is not None
        assert used == (mode == "always")
    target = {k: torch.empty_like(v) for k, v in sd.items()}  # (no fill kernel for uint16)
    loaded = load(target, tmp_path / "c")
    assert all(v.is_cuda for k, v in loaded.items() if k != "step")
    assert_bit_exact({k: v.cpu() for k, v in loaded.items()}, expected)


@pytest.fixture
def one_gpu_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    port = free_port()
    # async_save needs a CPU backend beside NCCL
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
def test_dtensor_on_a_one_gpu_mesh_round_trips(mode, one_gpu_mesh, tmp_path):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(64, 48, device="cuda").to(torch.bfloat16)
    sd = {"w": distribute_tensor(full, one_gpu_mesh, [Shard(0)]), "b": torch.randn(7).cuda()}
    with ArenaStager(device_copy=mode) as stager:
        resp = dcp.async_save(sd, storage_writer=LocalWriter(tmp_path / "c"),
                              planner=CachedSavePlanner(), async_stager=stager)
        stager.synchronize_staging()
        resp.upload_completion.result()
    target = {"w": distribute_tensor(torch.zeros_like(full), one_gpu_mesh, [Shard(0)]),
              "b": torch.zeros(7, device="cuda")}
    dcp.load(target, storage_reader=LocalReader(tmp_path / "c"), planner=SafeLoadPlanner())
    assert_bit_exact(target["w"].full_tensor().cpu(), full.cpu())
    assert_bit_exact(target["b"].cpu(), sd["b"].cpu())


def test_guard_in_gpu_mode_waits_for_the_device_copy_then_training_goes_on():
    p = torch.nn.Parameter(torch.ones(16 << 20, device="cuda"))
    p.grad = torch.ones_like(p)
    opt = torch.optim.SGD([p], lr=1.0)
    with ArenaStager(device_copy="always") as stager:
        stager.guard(opt)
        stager.stage({"p": p}).result()  # creates the side stream (the staged dict is dropped)
        assert stager.wait_persisted(30)
        with torch.cuda.stream(stager._engine.streams()[0]):
            torch.cuda._sleep(500_000_000)  # the device copy queues behind this: a guard that
        fut = stager.stage({"p": p})  # let the update run before it would stage p == 0
        opt.step()
        staged = fut.result()
        assert bool((staged["p"] == 1.0).all())
        assert bool((p == 0.0).all())
        status = stager.device_copy_status
        assert status.last_device_copy_s is not None and status.held_bytes >= p.nbytes
        del staged, fut


def test_gpu_mode_releases_the_guard_before_the_copy_to_host_is_done(monkeypatch):
    from dcp_plus.stagers import copy_engine

    plain = copy_engine.copy_bytes

    def slow_to_host(pairs, *, non_blocking=False):
        if pairs and pairs[0][1].device.type == "cpu":
            torch.cuda._sleep(1_000_000_000)  # the host copy queues behind ~0.5 s of sleep
        plain(pairs, non_blocking=non_blocking)

    monkeypatch.setattr(copy_engine, "copy_bytes", slow_to_host)
    sd = {"w": torch.randn(4 << 20, device="cuda")}
    with ArenaStager(device_copy="always") as stager:
        fut = stager.stage(sd)
        stager.synchronize_staging()
        assert not fut.done()  # released after the device copy, the host copy still queued
        staged = fut.result()
        assert torch.equal(staged["w"], sd["w"].cpu())
        del staged, fut


@pytest.mark.parametrize("mode", MODES)
def test_snapshots_while_the_next_forward_and_backward_run_are_never_stale_or_torn(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(256, 512, device="cuda")

    def train_step():
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()

    train_step()  # optimizer state exists
    with ArenaStager(device_copy=mode) as stager:
        stager.guard(opt)
        for _ in range(10):
            expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
            fut = stager.stage(model.state_dict())
            train_step()  # forward and backward queue at once; the update waits (guard)
            staged = fut.result()
            assert_bit_exact(dict(staged), {k: v.cpu() for k, v in expected.items()})
            del staged, fut
            assert stager.wait_persisted(30)


@pytest.mark.parametrize("mode", MODES)
def test_no_growth_over_200_snapshots(mode):
    sd = {f"w{i}": torch.randn(64 << 10, device="cuda") for i in range(64)}
    sd["step"] = torch.tensor(1.0)
    with ArenaStager(device_copy=mode) as stager:

        def snapshot():
            staged = stager.stage(sd).result()
            assert torch.equal(staged["w3"], sd["w3"].cpu())
            del staged
            assert stager.wait_persisted(30)

        snapshot()
        torch.cuda.synchronize()
        before = (torch.cuda.memory_allocated(), stager.nbytes, sorted(stager.slab_names()),
                  stager.device_copy_status.held_bytes)
        for _ in range(200):
            for t in sd.values():
                t.add_(1)
            snapshot()
        torch.cuda.synchronize()
        after = (torch.cuda.memory_allocated(), stager.nbytes, sorted(stager.slab_names()),
                 stager.device_copy_status.held_bytes)
        assert after == before  # device memory, page-locked slabs (one registration each)
        buf = stager._arenas[0].buffers[0]
        assert buf.pinned and all(b.is_pinned() for b in buf.bases)


def test_auto_rechecks_device_memory_before_every_snapshot():
    sd = {"w": torch.randn(8 << 20, device="cuda")}
    with ArenaStager(device_margin_bytes=0) as stager:

        def snapshot():
            staged = stager.stage(sd).result()
            assert torch.equal(staged["w"], sd["w"].cpu())
            del staged
            assert stager.wait_persisted(30)
            return stager.device_copy_status

        first = snapshot()
        assert first.last_device_copy_s is not None and first.held_bytes == sd["w"].nbytes
        stager._device.margin_bytes = torch.cuda.mem_get_info()[1]  # no room any more
        second = snapshot()
        assert second.last_device_copy_s is None and second.held_bytes == 0
        assert "host copy" in second.reason
        stager._device.margin_bytes = 0
        third = snapshot()
        assert third.last_device_copy_s is not None and "device copy" in third.reason
