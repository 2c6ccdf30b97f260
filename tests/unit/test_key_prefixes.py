"""Key-prefix strategies on fsspec's in-memory filesystem: each fake rank's objects under its
prefix, bit-exact loads, hostile record prefixes refused, and removal leaving nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_plus import (
    BinaryPrefixes,
    CheckpointFormatError,
    HexPrefixes,
    InvalidOptionError,
    LocalReader,
    ObjectStoreReader,
    ObjectStoreWriter,
    ObjectStoreWriterOptions,
    RoundRobinPrefixes,
    SafeLoadPlanner,
)
from dcp_plus.format.key_prefix import (
    MARKER_NAME,
    KeyPrefixes,
    decode_marker,
    encode_marker,
    insert_prefix,
    parse_key_prefixes,
)
from dcp_plus.format.record import seal
from dcp_plus.manager import CheckpointManager
from dcp_plus.manager.object_backend import ObjectStoreBackend
from dcp_plus.readers.inspect import verify
from tools.testkit.exact import assert_bit_exact

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FS = fsspec.filesystem("memory")


@pytest.fixture
def bucket() -> Iterator[str]:
    name = f"kp-{uuid.uuid4().hex[:10]}"
    yield name
    if FS.exists(f"/{name}"):
        FS.rm(f"/{name}", recursive=True)


def shards(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """What each of ``n`` fake ranks saves: tensors of its own and one value."""
    g = torch.Generator().manual_seed(seed)
    return [{f"r{r}.w": torch.randn(300, 17, generator=g),
             f"r{r}.i": torch.randint(-9, 9, (1001,), dtype=torch.int16, generator=g),
             f"r{r}.step": r + seed} for r in range(n)]


def fake_save(url: str, parts: list[dict[str, Any]], strategy: KeyPrefixes | None, *,
              commit: bool = True, **kw: Any) -> None:
    """A ``len(parts)``-rank save driven by hand, in this process (``memory://`` is per
    process): the StorageWriter calls DCP makes, in its order; no commit if not ``commit``."""
    n = len(parts)
    writers = [ObjectStoreWriter(url, key_prefixes=strategy, **kw) for _ in range(n)]
    planners = [DefaultSavePlanner() for _ in range(n)]
    for r in range(n):
        writers[r].set_up_storage_writer(r == 0, rank=r)
        planners[r].set_up_planner(parts[r], storage_meta=writers[r].storage_meta(),
                                   is_coordinator=r == 0)
    local = [writers[r].prepare_local_plan(planners[r].create_local_plan()) for r in range(n)]
    plans, metadata = planners[0].create_global_plan(local)
    plans = writers[0].prepare_global_plan(plans)
    results = [writers[r].write_data(planners[r].finish_plan(plans[r]), planners[r]).wait()
               for r in range(n)]
    if commit:
        writers[0].finish(metadata, results)


def load_all(url: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    expected = {k: v for p in parts for k, v in p.items()}
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
           for k, v in expected.items()}
    dcp.load(out, storage_reader=ObjectStoreReader(url), planner=SafeLoadPlanner(), no_dist=True)
    assert_bit_exact(out, expected)
    return out


def objects(bucket: str) -> list[str]:
    return sorted(p[len(bucket) + 2:] for p in FS.find(f"/{bucket}"))


def record(url: str) -> dict[str, Any]:
    return json.loads(FS.cat_file(url.removeprefix("memory://") + "/.metadata"))


# -- strategies ------------------------------------------------------------------------------

def test_strategies_give_each_rank_a_prefix_least_significant_digit_first() -> None:
    assert [HexPrefixes(2).prefix(r) for r in (0, 1, 15, 16, 17, 255, 256)] == \
        ["00", "10", "f0", "01", "11", "ff", "00"]
    assert [BinaryPrefixes(3).prefix(r) for r in range(5)] == ["000", "100", "010", "110", "001"]
    assert len(set(HexPrefixes(2).all())) == 256 and len(BinaryPrefixes(4).all()) == 16
    rr = RoundRobinPrefixes(["a", "b", "c"])
    assert [rr.prefix(r) for r in range(5)] == ["a", "b", "c", "a", "b"]
    assert parse_key_prefixes("hex:3") == HexPrefixes(3)
    assert parse_key_prefixes("round_robin:x,y") == RoundRobinPrefixes(["x", "y"])
    assert parse_key_prefixes("") is None


@pytest.mark.parametrize("make", [
    lambda: RoundRobinPrefixes(["a/b"]), lambda: RoundRobinPrefixes([".."]),
    lambda: RoundRobinPrefixes(["."]), lambda: RoundRobinPrefixes([""]),
    lambda: RoundRobinPrefixes(["a b"]), lambda: RoundRobinPrefixes(["x" * 65]),
    lambda: RoundRobinPrefixes([]), lambda: RoundRobinPrefixes(["a", "a"]),
    lambda: RoundRobinPrefixes("ab"), lambda: HexPrefixes(0), lambda: HexPrefixes(5),
    lambda: BinaryPrefixes(17), lambda: BinaryPrefixes(True),  # type: ignore[arg-type]
    lambda: parse_key_prefixes("hex"), lambda: parse_key_prefixes("md5:2"),
])
def test_unsafe_prefixes_and_depths_are_refused(make: Any) -> None:
    with pytest.raises(ValueError):
        make()


def test_insert_prefix_puts_the_prefix_after_the_bucket() -> None:
    assert insert_prefix("s3://b/run/step_1", "3f") == "s3://b/3f/run/step_1"
    assert insert_prefix("/b/k", "a") == "/b/a/k"
    assert insert_prefix("b/k/", "a") == "b/a/k"
    for no_key in ("s3://b", "s3://b/", "/b"):
        with pytest.raises(ValueError, match="checkpoint key below the bucket"):
            insert_prefix(no_key, "a")


def test_writer_and_options_refuse_bad_settings(bucket: str) -> None:
    with pytest.raises(InvalidOptionError, match="key_prefixes"):
        ObjectStoreWriter(f"memory://{bucket}/c", key_prefixes="hex:2")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="below the bucket"):
        ObjectStoreWriter(f"memory://{bucket}", key_prefixes=HexPrefixes(1))
    with pytest.raises(InvalidOptionError, match="object stores"):
        ObjectStoreWriter("file:///tmp/x/c", key_prefixes=HexPrefixes(1))
    with pytest.raises(InvalidOptionError, match="key_prefixes"):
        ObjectStoreWriterOptions(key_prefixes=["a"])  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="root must lie below the bucket"):
        ObjectStoreBackend().writer(f"memory://{bucket}/step_00000001",
                                    {"key_prefixes": HexPrefixes(1)})


# -- layout and round trips ------------------------------------------------------------------

@pytest.mark.parametrize("strategy", [HexPrefixes(1), BinaryPrefixes(2),
                                      RoundRobinPrefixes(["p-a", "p_b"])])
def test_ranks_objects_lie_under_their_prefixes_and_load_bit_exact(bucket: str,
                                                                   strategy: KeyPrefixes) -> None:
    url = f"memory://{bucket}/run/step_5"
    parts = shards(4)
    fake_save(url, parts, strategy)
    names = objects(bucket)
    assert {"run/step_5/.metadata", f"run/step_5/{MARKER_NAME}"} <= set(names)
    data = [n for n in names if n.endswith(".dcpp")]
    assert len(data) == 4 and not [n for n in names if n.endswith(".extents")]
    for r in range(4):
        [mine] = [n for n in data if n.rsplit("/", 1)[1].startswith(f"__{r}_")]
        assert mine.startswith(f"{strategy.prefix(r)}/run/step_5/")
    rec = record(url)
    assert rec["version"] == 3
    assert {(e["file"].split("_")[2], e["prefix"]) for e in rec["extents"]} == \
        {(str(r), strategy.prefix(r)) for r in range(4)}
    load_all(url, parts)
    assert verify(url).problems == []


def test_without_prefixes_the_record_and_layout_are_unchanged(bucket: str) -> None:
    url = f"memory://{bucket}/run/step_1"
    fake_save(url, shards(2), None)
    assert all(n.startswith("run/step_1/") for n in objects(bucket))
    rec = record(url)
    assert rec["version"] == 2 and not any("prefix" in e for e in rec["extents"])
    load_all(url, shards(2))


def test_a_flipped_byte_under_a_prefix_is_detected(bucket: str) -> None:
    url = f"memory://{bucket}/run/step_1"
    fake_save(url, shards(2), HexPrefixes(1))
    path = f"/{bucket}/" + next(n for n in objects(bucket) if n.startswith("1/"))
    raw = bytearray(FS.cat_file(path))
    raw[100] ^= 1
    FS.pipe_file(path, bytes(raw))
    [problem] = verify(url).problems
    assert "__1_0." in problem and "r1.w" in problem


def test_overwrite_removes_the_replaced_prefixed_objects(bucket: str) -> None:
    url = f"memory://{bucket}/run/step_1"
    fake_save(url, shards(2), HexPrefixes(1))
    first = set(n for n in objects(bucket) if n.endswith(".dcpp"))
    fake_save(url, shards(2, seed=1), RoundRobinPrefixes(["x", "y"]), overwrite=True)
    data = [n for n in objects(bucket) if n.endswith(".dcpp")]
    assert len(data) == 2 and not first & set(data)
    assert sorted(n.split("/")[0] for n in data) == ["x", "y"]
    load_all(url, shards(2, seed=1))


# -- hostile records -------------------------------------------------------------------------

def _edit(url: str, edit: Any) -> None:
    rec = record(url)
    rec.pop("record_checksum")
    edit(rec)
    FS.pipe_file(url.removeprefix("memory://") + "/.metadata",
                 seal(json.dumps(rec, separators=(",", ":")).encode()))


def _set_prefix(value: Any, row: int = 0) -> Any:
    return lambda rec: rec["extents"][row].__setitem__("prefix", value)


@pytest.mark.parametrize("edit, problem", [
    (_set_prefix("../x"), "not a key prefix"), (_set_prefix("a/b"), "not a key prefix"),
    (_set_prefix(".."), "not a key prefix"), (_set_prefix(""), "not a key prefix"),
    (_set_prefix(7), "expected"), (_set_prefix("q" * 65), "not a key prefix"),
    (lambda rec: rec.__setitem__("version", 2), "version-3"),
    (lambda rec: [e.__setitem__("prefix", "0" if e["fqn"] == "r1.i" else e["prefix"])
                  for e in rec["extents"]], "also recorded under key prefix"),
])
def test_hostile_record_prefixes_are_refused_naming_the_record(bucket: str, edit: Any,
                                                               problem: str) -> None:
    url = f"memory://{bucket}/run/step_1"
    fake_save(url, shards(2), HexPrefixes(1))
    _edit(url, edit)
    with pytest.raises(CheckpointFormatError, match=problem) as info:
        ObjectStoreReader(url).read_metadata()
    assert f"{url}/.metadata" in str(info.value) and "prefix" in str(info.value)


def test_a_prefixed_record_in_a_directory_is_refused_by_local_reader(bucket: str,
                                                                    tmp_path: Any) -> None:
    url = f"memory://{bucket}/run/step_1"
    fake_save(url, shards(2), HexPrefixes(1))
    (tmp_path / ".metadata").write_bytes(FS.cat_file(f"/{bucket}/run/step_1/.metadata"))
    with pytest.raises((CheckpointFormatError, CheckpointException), match="ObjectStoreReader"):
        dcp.load({"r0.w": torch.zeros(300, 17)}, storage_reader=LocalReader(tmp_path),
                 planner=SafeLoadPlanner(), no_dist=True)


# -- removal ---------------------------------------------------------------------------------

def test_manager_retention_removes_prefixed_objects(bucket: str) -> None:
    root = f"memory://{bucket}/run"
    opts = ObjectStoreWriterOptions(key_prefixes=RoundRobinPrefixes(["a", "b"]))
    with CheckpointManager(root, writer_options=opts, keep_last=1, interval=1) as m:
        for step in (1, 2):
            m.save(step, {"w": torch.full((1000,), float(step))}).result(timeout=60)
    names = objects(bucket)
    assert not [n for n in names if "step_00000001" in n]
    [data] = [n for n in names if n.endswith(".dcpp")]
    assert data.startswith("a/run/step_00000002/")
    backend = ObjectStoreBackend()
    assert backend.verify(f"{root}/step_00000002") == []
    FS.rm(f"/{bucket}/{data}")
    assert "missing" in backend.verify(f"{root}/step_00000002")[0]


def test_uncommitted_saves_are_cleaned_up_through_the_marker(bucket: str) -> None:
    root = f"memory://{bucket}/run"
    fake_save(f"{root}/step_00000003", shards(3), HexPrefixes(3), commit=False)  # a crash
    fake_save(f"{root}/step_00000004", shards(2), BinaryPrefixes(1), commit=False)
    assert sum(n.endswith(".dcpp") for n in objects(bucket)) == 5
    with CheckpointManager(root, interval=1) as m:  # configured without the strategies
        assert len(m.cleaned) == 2
    assert [n for n in objects(bucket) if not n.startswith("run/.")] == []


def test_a_hostile_marker_removes_nothing_outside_the_checkpoint(bucket: str) -> None:
    root = f"memory://{bucket}/run"
    FS.pipe_file(f"/{bucket}/keep/run/step_00000001/x", b"other data")
    FS.pipe_file(f"/{bucket}/run/step_00000001/{MARKER_NAME}", json.dumps(
        {"format": "dcp_plus-key-prefixes", "version": 1,
         "strategies": [{"kind": "round_robin", "prefixes": ["../keep"]}]}).encode())
    ObjectStoreBackend().remove_tree(f"{root}/step_00000001")
    assert objects(bucket) == ["keep/run/step_00000001/x"]
    FS.pipe_file(f"/{bucket}/run/step_00000001/{MARKER_NAME}",
                 encode_marker([RoundRobinPrefixes(["keep"])]))
    ObjectStoreBackend().remove_tree(f"{root}/step_00000001")  # its own folder under "keep"
    assert objects(bucket) == []


def test_cli_verify_and_gc_follow_the_prefixes(bucket: str, capsys: Any) -> None:
    from dcp_plus.cli.main import main

    root = f"memory://{bucket}/run"
    opts = ObjectStoreWriterOptions(key_prefixes=HexPrefixes(2))
    with CheckpointManager(root, writer_options=opts, keep_last=None, interval=1) as m:
        for step in (1, 2):
            m.save(step, {"w": torch.full((1000,), float(step))}).result(timeout=60)
    assert main(["verify", f"{root}/step_00000001"]) == 0
    assert main(["gc", root, "--keep-last", "1"]) == 0
    capsys.readouterr()
    names = objects(bucket)
    assert not [n for n in names if "step_00000001" in n]
    assert [n for n in names if n.endswith(".dcpp")][0].startswith("00/run/step_00000002/")
    assert main(["verify", f"{root}/step_00000002"]) == 0


def test_retention_finds_the_records_prefixes_without_the_marker(bucket: str) -> None:
    root = f"memory://{bucket}/run"
    opts = ObjectStoreWriterOptions(key_prefixes=RoundRobinPrefixes(["a", "b"]))
    with CheckpointManager(root, writer_options=opts, keep_last=1, interval=1) as m:
        m.save(1, {"w": torch.full((1000,), 1.0)}).result(timeout=60)
        FS.rm(f"/{bucket}/run/step_00000001/{MARKER_NAME}")  # lost, or never readable
        m.save(2, {"w": torch.full((1000,), 2.0)}).result(timeout=60)
    assert not [n for n in objects(bucket) if "step_00000001" in n]


def test_a_deeply_nested_marker_is_unreadable_not_fatal(bucket: str) -> None:
    path = f"memory://{bucket}/run/step_00000001"
    FS.pipe_file(f"/{bucket}/run/step_00000001/{MARKER_NAME}", b"[" * 100_000)
    with pytest.raises(ValueError, match=MARKER_NAME):
        decode_marker(b"[" * 100_000, f"{path}/{MARKER_NAME}")
    ObjectStoreBackend().remove_tree(path)
    assert objects(bucket) == []


def test_a_prefixed_record_on_a_file_system_url_reads_nothing_outside(bucket: str,
                                                                     tmp_path: Any) -> None:
    url = f"memory://{bucket}/run/step_1"
    fake_save(url, shards(2), HexPrefixes(1))
    ckpt = tmp_path / "run" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(FS.cat_file(f"/{bucket}/run/step_1/.metadata"))
    outside = tmp_path / "0" / "run" / "step_1"  # where a prefix "0" would point
    outside.mkdir(parents=True)
    for f in FS.find(f"/{bucket}/0/run/step_1"):
        (outside / f.rsplit("/", 1)[1]).write_bytes(FS.cat_file(f))
    with pytest.raises((CheckpointFormatError, CheckpointException), match="key prefixes"):
        dcp.load({"r0.w": torch.zeros(300, 17)},
                 storage_reader=ObjectStoreReader(f"file://{ckpt}"), planner=SafeLoadPlanner(),
                 no_dist=True)
