"""ArenaStager with DCP's PROCESS executor: the staged dict reaches the daemon by slab name."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_plus.stagers import ArenaStager
from tools.testkit import world

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.timeout(240),
]


@pytest.fixture(scope="module")
def single_rank_world():
    with world.single_rank_world():
        yield


def test_process_executor_saves_each_step_from_the_same_slabs(single_rank_world, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    with ArenaStager() as stager:
        stager.guard(opt)
        expected, names = [], []
        for step in range(3):
            model(torch.randn(8, 256)).sum().backward()
            opt.step()
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            resp = dcp.async_save(
                {"model": model.state_dict(), "step": step},
                storage_writer=dcp.FileSystemWriter(str(tmp_path / str(step))),
                async_stager=stager,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            resp.upload_completion.result()
            assert stager.wait_persisted(timeout=30)
            names.append(stager.slab_names())
            # torch's reducer would have moved the views into a new torch segment:
            assert all(b.views_alias_slabs() for a in stager._arenas for b in a.buffers)
        assert names[0] == names[1] == names[2]
    for step, exp in enumerate(expected):
        target = {"model": {k: torch.zeros_like(v) for k, v in exp.items()}, "step": -1}
        dcp.load(target, checkpoint_id=str(tmp_path / str(step)))
        assert target["step"] == step
        for k, v in exp.items():
            assert torch.equal(target["model"][k], v), (step, k)


def test_close_from_a_process_mode_upload_callback_returns(single_rank_world, tmp_path):
    # DCP's staging callback reads the staged dict on the stager's copy thread: that thread
    # must not pass for the save's, or close() in the upload callback waits forever
    import threading

    stager = ArenaStager()
    closed = threading.Event()
    resp = dcp.async_save({"w": torch.arange(4096.0)},
                          storage_writer=dcp.FileSystemWriter(str(tmp_path / "c")),
                          async_stager=stager,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    resp.upload_completion.add_done_callback(lambda _: (stager.close(), closed.set()))
    resp.upload_completion.result(timeout=120)
    assert closed.wait(120)
    target = {"w": torch.zeros(4096)}
    dcp.load(target, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(target["w"], torch.arange(4096.0))
