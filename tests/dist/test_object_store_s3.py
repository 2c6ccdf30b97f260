"""ObjectStoreWriter/ObjectStoreReader against a real S3 server (SeaweedFS) through stock DCP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import (
    ObjectStoreReader,
    ObjectStoreWriter,
    SafeLoadPlanner,
)
from tests.conftest import (
    ROOT,
    child_env,
    fill_pattern,
    pid_alive,
    registered_slab,
    wait_until,
    worker_pids,
)
from tests.dist._fault_proxy import FaultProxy
from tests.dist._s3_kill_child import v_state
from tools.testkit.exact import assert_bit_exact
from tools.testkit.seaweed import BUCKET, SeaweedServer
from tools.testkit.world import run_ranks

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
MiB = 1 << 20


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(3 * MiB, generator=g),  # 12 MiB: a multipart upload of 3 parts
        "bf16": torch.randn(257, 33, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-1000, 1000, (4099,), dtype=torch.int64, generator=g),
        "strided": torch.randn(64, 48, generator=g).t(),
        "empty": torch.empty(0, 3),
        "step": 17,
        "meta": {"lr": 0.5, "name": "run-a"},
    }


def zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    """A load target for ``sd``, in its key order: zeroed tensors, blank values."""
    blanks = {"step": 0, "meta": {"lr": 0.0, "name": ""}}
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else blanks[k]
            for k, v in sd.items()}


def s3_client(server: SeaweedServer) -> Any:
    import boto3

    opts = server.storage_options()
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=opts["key"],
                        aws_secret_access_key=opts["secret"], region_name="us-east-1")


def keys(server: SeaweedServer, prefix: str) -> list[str]:
    resp = s3_client(server).list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for o in resp.get("Contents", []))


@pytest.fixture
def prefix() -> str:
    return f"t/{uuid.uuid4().hex[:12]}"


# botocore's own retries off, so that the retries under test are dcp_plus's.
NO_BOTO_RETRY = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2,
                                   "read_timeout": 10}}


def load(url: str, opts: dict[str, Any], like: dict[str, Any], **kw: Any) -> dict[str, Any]:
    out = zeros_like(like)
    dcp.load(out, storage_reader=ObjectStoreReader(url, opts, **kw), planner=SafeLoadPlanner())
    return out


def test_round_trip_is_bit_exact_with_multipart_and_ranged_reads(seaweed: SeaweedServer,
                                                                  prefix: str) -> None:
    sd = state()
    url = f"s3://{BUCKET}/{prefix}"
    dcp.save(sd, storage_writer=ObjectStoreWriter(url, seaweed.storage_options(),
                                                  part_size=5 * MiB, concurrency=4))
    names = keys(seaweed, prefix)
    assert ".metadata" in names
    data = [n for n in names if n != ".metadata"]
    assert data and all(n.startswith("__0_") and n.endswith(".dcpp") for n in data)
    # small ranges and gaps: many parallel ranged GETs, neighbours coalesced
    out = load(url, seaweed.storage_options(), sd, range_size=1 * MiB, coalesce_gap=64 << 10,
               concurrency=4)
    assert_bit_exact(out, sd)


def test_flipped_byte_is_reported_with_tensor_name(seaweed: SeaweedServer, prefix: str) -> None:
    sd = {"weights": torch.arange(100_000, dtype=torch.float32)}
    url = f"s3://{BUCKET}/{prefix}"
    dcp.save(sd, storage_writer=ObjectStoreWriter(url, seaweed.storage_options()))
    (name,) = [n for n in keys(seaweed, prefix) if n.endswith(".dcpp")]
    client = s3_client(seaweed)
    body = bytearray(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")["Body"].read())
    body[12345] ^= 0x10
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=bytes(body))
    out = {"weights": torch.zeros(100_000)}
    with pytest.raises(BaseException, match=r"checksum mismatch in tensor 'weights'") as e:
        dcp.load(out, storage_reader=ObjectStoreReader(url, seaweed.storage_options()))
    assert name in str(e.value)


class _Unsafe:
    pass


def test_failed_save_leaves_no_commit_record(seaweed: SeaweedServer, prefix: str) -> None:
    url = f"s3://{BUCKET}/{prefix}"
    sd = {"w": torch.ones(1000), "bad": _Unsafe()}
    with pytest.raises(BaseException, match="weights_only"):
        dcp.save(sd, storage_writer=ObjectStoreWriter(url, seaweed.storage_options()))
    assert ".metadata" not in keys(seaweed, prefix)


def test_existing_checkpoint_is_kept_unless_overwrite(seaweed: SeaweedServer,
                                                      prefix: str) -> None:
    url = f"s3://{BUCKET}/{prefix}"
    first = {"w": torch.full((1000,), 1.0)}
    second = {"w": torch.full((1000,), 2.0)}
    dcp.save(first, storage_writer=ObjectStoreWriter(url, seaweed.storage_options()))
    old = keys(seaweed, prefix)
    with pytest.raises(BaseException, match="already holds a committed checkpoint") as e:
        dcp.save(second, storage_writer=ObjectStoreWriter(url, seaweed.storage_options()))
    assert "overwrite=True" in str(e.value)
    assert keys(seaweed, prefix) == old
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=ObjectStoreReader(url, seaweed.storage_options()))
    assert torch.equal(out["w"], first["w"])

    dcp.save(second, storage_writer=ObjectStoreWriter(url, seaweed.storage_options(),
                                                      overwrite=True))
    dcp.load(out, storage_reader=ObjectStoreReader(url, seaweed.storage_options()))
    assert torch.equal(out["w"], second["w"])
    new = keys(seaweed, prefix)
    assert not set(old) - {".metadata"} & set(new)  # the replaced data objects are gone


def test_record_commit_refuses_a_concurrent_commit(seaweed: SeaweedServer, prefix: str) -> None:
    """Two saves pass the existence check; only the first commit record is accepted, and the
    refused save removes its own objects."""
    url = f"s3://{BUCKET}/{prefix}"
    winner = {"w": torch.ones(10)}
    objects: list[str] = []

    class Racing(ObjectStoreWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            dcp.save(winner, storage_writer=ObjectStoreWriter(url, seaweed.storage_options()))
            objects.extend(keys(seaweed, prefix))
            super().finish(metadata, results)

    with pytest.raises(BaseException, match="CheckpointExistsError.*committed while this save"):
        dcp.save({"w": torch.zeros(100_000)},
                 storage_writer=Racing(url, seaweed.storage_options()))
    assert len(objects) > len(keys(seaweed, prefix)) == 2  # the winner's record and data
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=ObjectStoreReader(url, seaweed.storage_options()))
    assert torch.equal(out["w"], winner["w"])


def test_save_completes_bit_exact_through_resets_and_503s(seaweed: SeaweedServer,
                                                          prefix: str) -> None:
    proxy = FaultProxy(("127.0.0.1", seaweed.port), reset_fraction=0.2, error_fraction=0.2)
    try:
        opts = seaweed.storage_options(proxy.endpoint, **NO_BOTO_RETRY)
        sd = state()
        url = f"s3://{BUCKET}/{prefix}"
        dcp.save(sd, storage_writer=ObjectStoreWriter(url, opts, part_size=5 * MiB,
                                                      max_retries=10, retry_base_delay=0.01,
                                                      retry_max_delay=0.1))
        assert proxy.resets > 0 and proxy.errors > 0
        before = proxy.requests
        out = load(url, opts, sd, range_size=1 * MiB, max_retries=10, retry_base_delay=0.01,
                   retry_max_delay=0.1)
        assert_bit_exact(out, sd)
        assert proxy.requests > before
    finally:
        proxy.close()


def test_server_down_fails_save_clearly_and_earlier_checkpoint_loads(
        seaweed: SeaweedServer, prefix: str) -> None:
    proxy = FaultProxy(("127.0.0.1", seaweed.port))
    try:
        opts = seaweed.storage_options(proxy.endpoint, **NO_BOTO_RETRY)
        earlier = {"w": torch.randn(50_000)}
        dcp.save(earlier, storage_writer=ObjectStoreWriter(f"s3://{BUCKET}/{prefix}/a", opts))
        proxy.set_down(True)
        later_url = f"s3://{BUCKET}/{prefix}/b"
        with pytest.raises(BaseException, match=r"StorageError: .*failed after 3 attempt") as e:
            dcp.save({"w": torch.randn(50_000)},
                     storage_writer=ObjectStoreWriter(later_url, opts, max_retries=2,
                                                      retry_base_delay=0.01))
        assert later_url in str(e.value) and "endpoint is up" in str(e.value)
        proxy.set_down(False)
        assert ".metadata" not in keys(seaweed, f"{prefix}/b")
        out = {"w": torch.zeros(50_000)}
        dcp.load(out, storage_reader=ObjectStoreReader(f"s3://{BUCKET}/{prefix}/a", opts))
        assert torch.equal(out["w"], earlier["w"])
    finally:
        proxy.close()


@pytest.mark.parametrize("target", ["new_prefix", "overwrite"])
def test_trainer_killed_mid_upload_keeps_last_checkpoint(seaweed: SeaweedServer, prefix: str,
                                                         tmp_path: Path, target: str) -> None:
    """Invariant 3 on S3: SIGKILL while a part of the next save is in flight (held by the
    proxy, so the kill provably lands mid-upload) costs nothing committed, and the writer
    workers that were uploading it exit."""
    proxy = FaultProxy(("127.0.0.1", seaweed.port))
    old = f"s3://{BUCKET}/{prefix}/step_1"
    new = old if target == "overwrite" else f"s3://{BUCKET}/{prefix}/step_2"
    ready, go = tmp_path / "ready", tmp_path / "go"
    opts = seaweed.storage_options(proxy.endpoint)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.dist._s3_kill_child", json.dumps(opts), old, new,
         str(ready), str(go)], cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: ready.exists() or child.poll() is not None, 120, "v1 committed")
        assert child.poll() is None, f"child exited {child.returncode} before v2"
        proxy.hold(b"partNumber=")
        go.touch()
        assert proxy.held.wait(60), "v2's upload never reached the proxy"
        workers = worker_pids(child.pid)
        assert workers, "v2 was not uploaded by the child's writer workers"
        child.kill()
        assert child.wait(30) == -9
        wait_until(lambda: not any(pid_alive(p) for p in workers), 30,
                   "the dead trainer's writer workers to exit mid-upload")
    finally:
        if child.poll() is None:
            child.kill()
        proxy.close()
    assert not Path(str(ready) + ".finished").exists()
    direct = seaweed.storage_options()
    v1 = v_state(1)
    out = {"big": torch.zeros_like(v1["big"]), "small": torch.zeros_like(v1["small"]),
           "step": 0}
    dcp.load(out, storage_reader=ObjectStoreReader(old, direct), planner=SafeLoadPlanner())
    assert torch.equal(out["big"], v1["big"]) and torch.equal(out["small"], v1["small"])
    assert out["step"] == 1
    if target == "new_prefix":
        assert ".metadata" not in keys(seaweed, f"{prefix}/step_2")
        with pytest.raises(BaseException, match=r"step_2: no commit record"):
            dcp.load(out, storage_reader=ObjectStoreReader(new, direct))


def slab_state(slab: Any) -> dict[str, Any]:
    """Two tensors in a registered slab (uploaded by the worker pool) and one outside it."""
    t = slab.tensor()
    fill_pattern(t, seed=3)
    return {"big": t[: 12 * MiB].view(torch.float32),  # 3 parts of 5 MiB (the last shorter)
            "tail": t[12 * MiB + 4096: 12 * MiB + 8096].view(torch.int32),
            "plain": torch.randn(1000, generator=torch.Generator().manual_seed(5))}


def test_slab_data_is_uploaded_by_the_worker_pool_bit_exact(seaweed: SeaweedServer,
                                                             prefix: str) -> None:
    opts = seaweed.storage_options()
    url = f"s3://{BUCKET}/{prefix}"
    with registered_slab(16 * MiB) as slab:
        sd = slab_state(slab)
        dcp.save(sd, storage_writer=ObjectStoreWriter(url, opts, part_size=5 * MiB))
        assert worker_pids(), "no writer worker ran"
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=ObjectStoreReader(url, opts), planner=SafeLoadPlanner())
        assert_bit_exact(out, sd)


def test_capped_uploads_by_workers_and_trainer_stay_under_the_cap(seaweed: SeaweedServer,
                                                                  prefix: str) -> None:
    from dcp_plus.storage.rate import GRANT

    opts, url = seaweed.storage_options(), f"s3://{BUCKET}/{prefix}"
    cap, part = 16 * MiB, 5 * MiB
    with registered_slab(24 * MiB) as slab:
        t = slab.tensor()
        fill_pattern(t, seed=4)
        sd = {"big": t[: 20 * MiB].view(torch.float32),  # 4 parts, uploaded by the workers
              "plain": torch.randn(GRANT // 4, generator=torch.Generator().manual_seed(6))}
        writer = ObjectStoreWriter(url, opts, part_size=part, max_bytes_per_s=cap)
        t0 = time.monotonic()
        dcp.save(sd, storage_writer=writer)
        wall = time.monotonic() - t0
        assert worker_pids(), "no writer worker ran"
        p = writer.last_persist
        assert p is not None and p.data_bytes >= 24 * MiB
        floor = (24 * MiB - part) / cap  # a request waits for its whole part: grain part_size
        assert p.write_s >= floor and wall >= floor
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=ObjectStoreReader(url, opts), planner=SafeLoadPlanner())
        assert_bit_exact(out, sd)


def test_worker_killed_mid_upload_fails_the_save_and_the_next_one_succeeds(
        seaweed: SeaweedServer, prefix: str) -> None:
    proxy = FaultProxy(("127.0.0.1", seaweed.port))
    opts = seaweed.storage_options(proxy.endpoint, **NO_BOTO_RETRY)
    url = f"s3://{BUCKET}/{prefix}"
    try:
        with registered_slab(16 * MiB) as slab, ThreadPoolExecutor(1) as ex:
            sd = slab_state(slab)
            dcp.save({"warm": sd["tail"]}, storage_writer=ObjectStoreWriter(
                f"{url}-warm", opts, part_size=5 * MiB))  # the pool is up before the hold
            proxy.hold(b"partNumber=")
            saving = ex.submit(dcp.save, sd, storage_writer=ObjectStoreWriter(
                url, opts, part_size=5 * MiB, max_retries=1, retry_base_delay=0.01))
            assert proxy.held.wait(60), "the worker's upload never reached the proxy"
            for pid in worker_pids():
                os.kill(pid, signal.SIGKILL)
            proxy.release()
            with pytest.raises(BaseException, match=r"writer worker pid \d+ died .*__0_0\."):
                saving.result(timeout=120)
            assert ".metadata" not in keys(seaweed, prefix)
            dcp.save(sd, storage_writer=ObjectStoreWriter(url, opts, part_size=5 * MiB))
            out = {k: torch.zeros_like(v) for k, v in sd.items()}
            dcp.load(out, storage_reader=ObjectStoreReader(url, opts))
            assert_bit_exact(out, sd)
    finally:
        proxy.close()


def test_wrong_secret_fails_without_retrying(seaweed: SeaweedServer, prefix: str) -> None:
    url = f"s3://{BUCKET}/{prefix}"
    dcp.save({"w": torch.ones(10)}, storage_writer=ObjectStoreWriter(
        url, seaweed.storage_options()))
    opts = seaweed.storage_options(secret="not-the-secret")
    with pytest.raises(BaseException, match=r"after 1 attempt\(s\) \(HTTP 403 SignatureDoesNot"):
        dcp.load({"w": torch.zeros(10)}, storage_reader=ObjectStoreReader(url, opts))


def test_two_gloo_ranks_save_per_rank_objects_and_one_record(seaweed: SeaweedServer,
                                                             prefix: str) -> None:
    from tests.dist._ranks import rank_state, save_two_ranks

    url = f"s3://{BUCKET}/{prefix}"
    run_ranks(2, save_two_ranks, url, seaweed.storage_options())
    names = keys(seaweed, prefix)
    assert ".metadata" in names
    assert {n.split("_")[2] for n in names if n.endswith(".dcpp")} == {"0", "1"}
    expected = {**rank_state(0), **rank_state(1)}
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=ObjectStoreReader(url, seaweed.storage_options()))
    assert_bit_exact(out, expected)


def test_two_gloo_ranks_write_under_their_key_prefixes_and_retention_removes_them(
        seaweed: SeaweedServer, prefix: str) -> None:
    from tests.dist._ranks import manager_saves_under_prefixes, rank_state

    tag = uuid.uuid4().hex[:8]
    spread = [f"kp{tag}a", f"kp{tag}b"]
    root = f"s3://{BUCKET}/{prefix}/run"
    run_ranks(2, manager_saves_under_prefixes, root, seaweed.storage_options(), spread)
    for rank, p in enumerate(spread):  # each rank's objects under its own prefix; step 1 gone
        under = keys(seaweed, f"{p}/{prefix}/run")
        assert [n.split("/")[0] for n in under] == ["step_00000002"]
        assert under[0].split("/")[1].startswith(f"__{rank}_")
    assert not [n for n in keys(seaweed, prefix) if n.endswith(".dcpp")]
    assert not [n for n in keys(seaweed, prefix) if n.startswith("run/step_00000001/")]
    expected = {k: v + 2 for r in (0, 1) for k, v in rank_state(r).items()}
    assert_bit_exact(load(f"{root}/step_00000002", seaweed.storage_options(), expected),
                     expected)


def test_zstd_shuffle_round_trip_over_multipart(seaweed: SeaweedServer, prefix: str) -> None:
    sd = state()
    url = f"s3://{BUCKET}/{prefix}"
    dcp.save(sd, storage_writer=ObjectStoreWriter(url, seaweed.storage_options(),
                                                  part_size=5 * MiB, codec="zstd+shuffle"))
    md = ObjectStoreReader(url, seaweed.storage_options()).read_metadata()
    assert {e.codec for i, e in md.storage_data.items() if i.fqn == "big"} == {"zstd+shuffle"}
    assert_bit_exact(load(url, seaweed.storage_options(), sd, range_size=2 * MiB), sd)


def test_checkpoint_manager_on_s3_commits_retains_and_resumes(seaweed: SeaweedServer,
                                                              prefix: str) -> None:
    from dcp_plus.manager import CheckpointManager

    root = f"s3://{BUCKET}/{prefix}/run"
    states = {}
    with CheckpointManager(root, storage_options=seaweed.storage_options(), keep_last=2,
                           interval=1) as m:
        for step in (1, 2, 3):
            states[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in state().items()}
            m.save(step, states[step]).result(timeout=120)
        assert [c.step for c in m.list()] == [2, 3] and m.latest_step() == 3
    assert not any(k.startswith("run/step_00000001/") for k in keys(seaweed, prefix))
    out = zeros_like(states[3])
    with CheckpointManager(root, storage_options=seaweed.storage_options()) as m:
        assert m.load_latest(out) == 3
    assert_bit_exact(out, states[3])


def test_object_shrinking_or_server_failing_during_load_is_reported(seaweed: SeaweedServer,
                                                                    prefix: str) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from dcp_plus import CorruptCheckpointError, StorageError

    proxy = FaultProxy(("127.0.0.1", seaweed.port))
    try:
        opts = seaweed.storage_options(proxy.endpoint, **NO_BOTO_RETRY)
        sd = {"w": torch.randn(3 * MiB)}  # 12 MiB: 3 ranged GETs of 4 MiB
        url = f"s3://{BUCKET}/{prefix}"
        dcp.save(sd, storage_writer=ObjectStoreWriter(url, opts, part_size=5 * MiB))
        (name,) = [n for n in keys(seaweed, prefix) if n.endswith(".dcpp")]

        def reader_ready() -> tuple[ObjectStoreReader, Any, Any]:
            reader = ObjectStoreReader(url, opts, range_size=4 * MiB, max_retries=1,
                                       retry_base_delay=0.01)
            md = reader.read_metadata()
            reader.set_up_storage_reader(md, True)  # sizes checked here
            planner = DefaultLoadPlanner()
            planner.set_up_planner({"w": torch.zeros(3 * MiB)}, md, True)
            return reader, planner, planner.create_local_plan()

        reader, planner, plan = reader_ready()
        proxy.set_down(True)
        with pytest.raises(StorageError, match=r"GET .*bytes .*failed after 2 attempt"):
            reader.read_data(plan, planner)
        proxy.set_down(False)

        reader, planner, plan = reader_ready()
        client = s3_client(seaweed)
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}")["Body"].read()
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=body[:5 * MiB])
        with pytest.raises(CorruptCheckpointError, match="truncated object") as e:
            reader.read_data(plan, planner)
        assert name in str(e.value)
    finally:
        proxy.close()


def test_an_s3_root_has_one_writer_held_by_conditional_puts(seaweed: SeaweedServer,
                                                            prefix: str) -> None:
    from dcp_plus.errors import CheckpointSaveError, LeaseHeldError
    from dcp_plus.manager import CheckpointManager
    from dcp_plus.manager.lease import LEASE_DIR, Holder, gen_name
    from dcp_plus.manager.object_backend import ObjectStoreBackend

    root, opts = f"s3://{BUCKET}/{prefix}/run", seaweed.storage_options()
    store = ObjectStoreBackend(opts).lease_store(f"{root}/{LEASE_DIR}")
    with ThreadPoolExecutor(8) as pool:  # the server decides: exactly one create wins
        wins = list(pool.map(lambda i: store.create("race", f"{i}".encode()), range(8)))
    assert wins.count(True) == 1

    with CheckpointManager(root, storage_options=opts, interval=1) as m:
        m.save(1, state()).result(timeout=120)
        with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
            CheckpointManager(root, storage_options=opts)
        with CheckpointManager(root, storage_options=opts, read_only=True) as reader:
            out = zeros_like(state())
            assert reader.load_latest(out) == 1
        gens = [n for n in store.list() if n.startswith("gen-") and n[4:].isdigit()]
        usurper = Holder(generation=int(max(gens)[4:]) + 1, holder_id="u", host="other-node",
                         pid=1, started=0.0, command="other job")
        assert store.create(gen_name(usurper.generation), usurper.encode())
        before = keys(seaweed, prefix)
        with pytest.raises(CheckpointSaveError, match="LeaseLostError.*other-node"):
            m.save(2, state()).result(timeout=120)
        assert keys(seaweed, prefix) == before  # the fenced writer wrote nothing
    # the usurper never heartbeats: expired, so a restart may take the root back
    with CheckpointManager(root, storage_options=opts, takeover=True) as again:
        assert "other-node" in (again.took_over or "")
        out = zeros_like(state())
        assert again.load_latest(out) == 1
        again.save(3, state()).result(timeout=120)
