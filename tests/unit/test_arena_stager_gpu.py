"""ArenaStager with CUDA tensors: page-locked slabs, side-stream ordering, one registration per slab."""

from __future__ import annotations

import pytest
import torch

from dcp_plus.stagers import ArenaStager

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
