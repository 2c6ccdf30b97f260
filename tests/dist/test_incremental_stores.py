"""Incremental chains on the real servers: SeaweedFS (S3) and nfs-ganesha (NFSv4): each link
holds only what changed, loads bit-exact through its references, and a deleted base is named
with its URL."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus import NFSReader, NFSWriter, ObjectStoreReader, ObjectStoreWriter, SafeLoadPlanner
from dcp_plus.manager import CheckpointManager
from tests.conftest import assert_bit_exact, clone_state, load_target, random_tensor
from tests.dist.test_object_store_s3 import keys, s3_client
from tools.testkit.ganesha import GaneshaServer
from tools.testkit.seaweed import BUCKET, SeaweedServer

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
MiB = 1 << 20


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(9)
    return {"emb": random_tensor((4096, 256), torch.float32, gen),  # 4 parts
            "frozen": random_tensor((3 * MiB // 2,), torch.bfloat16, gen), "step": 0}


def _step(sd: dict[str, Any], k: int) -> None:
    sd["emb"][k % 4 * 1024 + 7] += 1.0  # one part changes per link
    sd["step"] = k


def _chain(sd: dict[str, Any], urls: list[str], writer: Any, opts: dict[str, Any]
           ) -> list[dict[str, Any]]:
    seen = []
    for k, u in enumerate(urls):
        _step(sd, k)
        base = {"incremental": True} if k == 0 else {"base": urls[k - 1]}
        dcp.save(sd, storage_writer=writer(u, opts, **base), no_dist=True)
        seen.append(clone_state(sd))
    return seen


def _load(like: dict[str, Any], url: str, reader: Any, opts: dict[str, Any]) -> dict[str, Any]:
    out = load_target(like)
    dcp.load(out, storage_reader=reader(url, opts), planner=SafeLoadPlanner(), no_dist=True)
    return out


def test_an_s3_chain_stores_only_changed_parts_and_loads_bit_exact(seaweed: SeaweedServer):
    prefix = f"t/{uuid.uuid4().hex[:12]}"
    opts = seaweed.storage_options()
    urls = [f"s3://{BUCKET}/{prefix}/s{k}" for k in range(3)]
    seen = _chain(_state(), urls, lambda u, o, **kw: ObjectStoreWriter(u, o, part_size=5 * MiB,
                                                                       **kw), opts)

    for u, want in zip(urls, seen, strict=True):
        assert_bit_exact(_load(want, u, ObjectStoreReader, opts), want)
    client = s3_client(seaweed)
    sizes = {k: sum(o["Size"] for o in client.list_objects_v2(
        Bucket=BUCKET, Prefix=f"{prefix}/s{k}/")["Contents"]) for k in range(3)}
    assert sizes[0] > 7 * MiB and sizes[1] < 2 * MiB and sizes[2] < 2 * MiB, sizes

    for name in keys(seaweed, f"{prefix}/s0"):  # the base goes: the children are refused
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/s0/{name}")
    with pytest.raises(CheckpointException) as info:
        _load(seen[2], urls[2], ObjectStoreReader, opts)
    assert f"{prefix}/s0" in str(info.value) and "base checkpoint 's0'" in str(info.value)


def test_a_manager_on_s3_chains_deltas_and_resumes(seaweed: SeaweedServer):
    root = f"s3://{BUCKET}/t/{uuid.uuid4().hex[:12]}/run"
    sd = _state()
    with CheckpointManager(root, storage_options=seaweed.storage_options(), interval=1,
                           incremental=True, delta=True, keep_last=1) as m:
        for k in range(1, 4):
            _step(sd, k)
            m.save(k, sd).result(timeout=120)
        assert [c.step for c in m.list()] == [1, 2, 3]  # 3 references 1 and 2
    out = load_target(sd)
    with CheckpointManager(root, storage_options=seaweed.storage_options(), read_only=True) as m:
        assert m.load_latest(out) == 3
    assert_bit_exact(out, sd)


def test_an_nfs_chain_loads_bit_exact_through_its_references(ganesha: GaneshaServer):
    run = f"t/{uuid.uuid4().hex[:12]}"
    urls = [f"{ganesha.url}/{run}/s{k}{ganesha.query()}" for k in range(3)]
    seen = _chain(_state(), urls, lambda u, o, **kw: NFSWriter(u, retry_base_delay=0.0, **kw),
                  {})

    for u, want in zip(urls, seen, strict=True):
        assert_bit_exact(_load(want, u, lambda u_, o: NFSReader(u_), {}), want)
