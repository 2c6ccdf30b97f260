"""The memory and peer tiers in a real TorchTitan training loop (``checkpoint.memory_tier``):
a job SIGKILLed after a save kept in memory only resumes from memory and from its partner's
replica, bit-exact. The loop and its CPU shims are ``tests/dist/test_torchtitan.py``'s;
job A (``titan_reference``) is the uninterrupted run both compare with."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan",
    reason="TorchTitan is not installed (pip install 'dcp-plus[torchtitan]', torchtitan==0.3.0)")
pytest.importorskip("tokenizers", reason="TorchTitan's tokenizer needs `tokenizers`")

from dcp_plus.tiers import names  # noqa: E402
from tools.testkit.titan.run import committed_steps, log_tail, losses_of, titan_job  # noqa: E402

STEPS = 12  # titan_job's: a checkpoint every 3 steps
KILL_AT = 8  # step 3's save (the 1st: durable) and step 6's (memory only) are complete then


@pytest.mark.parametrize("async_mode", ["async", "disabled"])
def test_memory_tier_resumes_the_newest_step_from_memory_and_partner_bit_exact(
        titan_reference: dict[str, Any], async_mode: str) -> None:
    """K: the dcp_plus recipe with the memory and peer tiers (every 2nd save persisted) is
    SIGKILLed when step 8 starts, once its step-6 save has completed; node 1 (rank 1) then
    loses its memory; L restarts K unchanged. With ``async_mode="disabled"`` each save
    blocks until its snapshot is kept, replicated and, when due, persisted."""
    root, job = titan_reference["root"], f"t{uuid.uuid4().hex[:12]}"
    k, ell = f"K-{async_mode}", f"L-{async_mode}"
    flags = ["--checkpoint.memory_tier", "--checkpoint.durable_every", "2",
             "--checkpoint.peer_tier", "--checkpoint.ranks_per_node", "1",
             "--checkpoint.job_id", job, "--checkpoint.async_mode", async_mode]
    try:
        killed = titan_job(root, k, "dcp_plus_cpu", root / k, flags,
                           {"DCPP_TITAN_KILL_AT": str(KILL_AT), "DCPP_TITAN_KILL_SETTLED": "1"})
        assert all(code != 0 for code in killed), "job K was meant to be killed at step 8"
        assert committed_steps(root / k / "checkpoint") == [3]  # 6: in memory only
        # step 6 complete in every rank's memory and in its partner's before the kill
        assert sorted((f.holder, f.owner, f.step) for f in names.listing(job)
                      if f.kind == "record") == [(0, 0, 6), (0, 1, 6), (1, 0, 6), (1, 1, 6)]
        for f in names.listing(job):
            if f.holder == 1:
                names.unlink(f.name)
        resumed = titan_job(root, ell, "dcp_plus_cpu", root / k, flags)
        assert resumed == [0, 0], log_tail(root, ell)
        assert names.listing(job) == []  # the finished job freed its memory
    finally:
        for f in names.listing(job):
            names.unlink(f.name)
    log = (root / f"{ell}.rank0.log").read_text()
    # rank 0 from its own memory, rank 1 from rank 0's replica; durable step 3 is not read
    assert "dcp_plus: restored step 6 from ['memory', 'peer']" in log
    assert "Loading the checkpoint from" not in log
    a, killed_losses, resumed_losses = (losses_of(root / f"{n}.losses.jsonl")
                                        for n in ("A", k, ell))
    assert sorted(killed_losses) == list(range(1, KILL_AT))
    assert sorted(resumed_losses) == list(range(7, STEPS + 1))
    for step, loss in {**killed_losses, **resumed_losses}.items():  # model, optimizer, LR, data position
        assert loss == a[step], (step, loss, a[step])
    # L's 1st save (step 9) is durable, and so is the last step
    assert committed_steps(root / k / "checkpoint") == [3, 9, STEPS]
