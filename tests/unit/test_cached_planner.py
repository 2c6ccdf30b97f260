"""CachedSavePlanner in one process: fingerprints, writer keys, LRU, pickling, hit/miss."""

from __future__ import annotations

import dataclasses
import enum
import gc
import json
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan

from dcp_plus._compat.torch_dcp import flatten_state_dict
from dcp_plus.format.storage_meta import JsonRecordStorageMeta
from dcp_plus.planners import cached_save
from dcp_plus.planners._fingerprint import (
    structure_digest,
    structure_entries,
    writer_key,
)
from dcp_plus.planners._flatten import Flat, flatten_with_entries
from dcp_plus.planners.cache import LRU, CachedMetadata
from dcp_plus.planners.cached_save import CachedSavePlanner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _sd(n: int = 5, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((4, 2), float(i), dtype=dtype) for i in range(n)},
            "step": 3}


def _flat(sd: dict[str, Any]) -> dict[str, Any]:
    return {f"model.{k}": v for k, v in sd["model"].items()} | {"step": sd["step"]}


def _save(sd: dict[str, Any], path: Path, planner: Any, writer: Any = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer or FileSystemWriter(path), planner=planner,
                 no_dist=True)


def test_fingerprint_ignores_values_and_non_tensor_types() -> None:
    a, b = _sd(), _sd()
    b["model"]["w0"].add_(5)
    b["step"] = "a string now"
    assert structure_digest(_flat(a)) == structure_digest(_flat(b))


@pytest.mark.parametrize("change", ["dtype", "shape", "new_key", "requires_grad", "to_bytes"])
def test_fingerprint_changes_with_every_plan_input(change: str) -> None:
    a, b = _sd(), _sd()
    if change == "dtype":
        b["model"]["w1"] = b["model"]["w1"].bfloat16()
    elif change == "shape":
        b["model"]["w1"] = b["model"]["w1"].reshape(8)
    elif change == "new_key":
        b["model"]["extra"] = torch.zeros(1)
    elif change == "requires_grad":
        b["model"]["w1"].requires_grad_(True)
    else:
        b["model"]["w1"] = [1, 2]
    assert structure_digest(_flat(a)) != structure_digest(_flat(b))


def test_fingerprint_covers_key_paths_and_context() -> None:
    flat = _flat(_sd())
    paths = {k: tuple(k.split(".")) for k in flat}
    assert structure_digest(flat, paths) != structure_digest(flat, {k: (k,) for k in flat})
    assert structure_digest(flat, context=(2,)) != structure_digest(flat, context=(4,))


def _nested(case: int) -> dict[Any, Any]:
    t, p = torch.ones(2), torch.nn.Parameter(torch.zeros(3))
    return [
        {"a": {"b": t, "c": 1, "p": p}, "d": [1, 2], "e": (t, 3), "s": "x"},
        {"optim": {"state": {0: {"exp_avg": t, "step": torch.tensor(1.0)}},
                   "param_groups": [{"lr": 0.1, "params": ["a.b", "a.p"]}]}},
        {"l": [t, [t, 1], {"x": t}], "empty": {}, "n": None, 3: "int key", "b": b"raw"},
        {"m": OrderedDict(a=t), "nested": [[1, 2], [3]], "mixed": [1, {"k": 2}], "z": [[t]]},
    ][case]


@pytest.mark.parametrize("case", range(4))
def test_one_pass_flatten_matches_dcp_flatten(case: int) -> None:
    sd = _nested(case)
    flat = flatten_with_entries(sd)
    assert flat is not None and not flat.has_sharded
    ref, mappings = flatten_state_dict(sd)
    assert list(flat.state_dict) == list(ref) and flat.mappings == mappings
    assert all(a is b for a, b in zip(flat.state_dict.values(), ref.values(), strict=True))
    assert flat.entries == structure_entries(ref, mappings)


def test_one_pass_flatten_refuses_duplicate_keys_like_dcp() -> None:
    sd = {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_state_dict(sd)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_with_entries(sd)


def test_nesting_is_part_of_the_structure() -> None:
    a = flatten_with_entries({"a.b": torch.ones(1)})
    b = flatten_with_entries({"a": {"b": torch.ones(1)}})
    assert a is not None and b is not None
    assert list(a.state_dict) == list(b.state_dict) and a.entries != b.entries


def test_writer_key_ignores_paths_but_sees_type_and_settings(tmp_path: Path) -> None:
    class Other(FileSystemWriter):
        pass

    base = writer_key(FileSystemWriter(tmp_path / "a"))
    assert writer_key(FileSystemWriter(tmp_path / "b")) == base
    assert writer_key(FileSystemWriter(tmp_path / "a", thread_count=3)) != base
    assert writer_key(Other(tmp_path / "a")) != base

    class Declared(FileSystemWriter):
        def plan_cache_key(self) -> str:
            return "v1"

    assert writer_key(Declared(tmp_path / "a")).endswith(":v1")


def test_lru_evicts_least_recently_used() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1
    lru.put("c", 3)
    assert "b" not in lru and lru.keys() == ["a", "c"]
    with pytest.raises(ValueError):
        LRU(0)


def test_second_save_is_a_hit_and_loads_bit_exact(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    assert not planner.last_was_hit
    sd["model"]["w2"].mul_(3)
    _save(sd, tmp_path / "1", planner)
    assert planner.last_was_hit
    out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "1"), no_dist=True)
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())
    assert out["step"] == 3


def test_dtype_switch_replans_and_the_record_says_bfloat16(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    _save(sd, tmp_path / "1", planner)
    sd["model"]["w0"] = sd["model"]["w0"].bfloat16()
    _save(sd, tmp_path / "2", planner)
    assert not planner.last_was_hit
    md = FileSystemReader(tmp_path / "2").read_metadata()
    assert md.state_dict_metadata["model.w0"].properties.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (page-locked memory)")
def test_pinning_a_tensor_replans_and_the_record_says_pinned(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    sd["model"]["w1"] = sd["model"]["w1"].pin_memory()
    _save(sd, tmp_path / "1", planner)
    assert not planner.last_was_hit
    md = FileSystemReader(tmp_path / "1").read_metadata()
    assert md.state_dict_metadata["model.w1"].properties.pin_memory
    assert not md.state_dict_metadata["model.w0"].properties.pin_memory


def test_without_an_accelerator_no_tensor_is_pinned_so_none_is_asked() -> None:
    from dcp_plus.planners._flatten import pinning_possible

    assert pinning_possible() == torch.accelerator.is_available()
    if not pinning_possible():
        with pytest.raises(RuntimeError):  # pinning needs an accelerator
            torch.zeros(4).pin_memory()


def test_two_planners_never_share_entries(tmp_path: Path) -> None:
    sd, first, second = _sd(), CachedSavePlanner(), CachedSavePlanner()
    _save(sd, tmp_path / "0", first)
    _save(sd, tmp_path / "1", second)
    assert not second.last_was_hit and second.cache is not first.cache


def test_commit_record_pickles_as_stock_metadata() -> None:
    md = CachedMetadata.for_save(Metadata({"x": None}, planner_data={"x": ("x",)}), b"k" * 16)  # type: ignore[dict-item]
    blob = pickle.dumps(md)
    assert b"dcp_plus" not in blob
    back = pickle.loads(blob)
    assert type(back) is Metadata and back.planner_data == {"x": ("x",)}


def test_the_broadcast_token_is_the_first_pickle_only() -> None:
    import copy

    md = CachedMetadata.for_save(Metadata({"x": None}, planner_data={"x": ("x",)}), b"k" * 16,  # type: ignore[dict-item]
                                 token_once=True)
    md.storage_meta = JsonRecordStorageMeta(checkpoint_id="/c", save_id="s")
    for other in (copy.copy(md), copy.deepcopy(md)):  # copies are plain, the token stays
        assert type(other) is Metadata and other.planner_data == {"x": ("x",)}
    token = pickle.dumps(md)
    assert b"_expand_metadata" in token and b"JsonRecordStorageMeta" not in token
    later = pickle.dumps(md)  # a PROCESS daemon's pipe, the caller: the full Metadata
    assert b"dcp_plus" not in later
    back = pickle.loads(later)
    assert type(back) is Metadata and back.planner_data == {"x": ("x",)}
    assert type(back.storage_meta) is StorageMeta and back.storage_meta.save_id == "s"


def test_a_dcp_plus_writers_storage_meta_is_recorded_and_pickled_as_a_plain_one() -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from dcp_plus.format.record import Extent, decode_record, encode_record
    from dcp_plus.writers import LocalWriter

    sm = LocalWriter("/tmp/ck").storage_meta()
    assert isinstance(sm, JsonRecordStorageMeta)
    plain = StorageMeta(checkpoint_id="/c", save_id="s", modules=["m"])
    ours = JsonRecordStorageMeta(checkpoint_id="/c", save_id="s", modules=["m"])
    assert ours == plain and plain == ours and ours != StorageMeta(checkpoint_id="/c")
    blob = pickle.dumps(ours)
    assert b"dcp_plus" not in blob and type(pickle.loads(blob)) is StorageMeta
    md = Metadata({"step": BytesStorageMetadata()}, storage_meta=ours, version="1")
    extents = {MetadataIndex("step"): Extent("__0_0.s.dcpp", 0, 4, 4, "identity",
                                             "xxh3-64id:" + "0" * 15 + "1")}
    record = encode_record(md, extents)
    assert record == encode_record(dataclasses.replace(md, storage_meta=plain), extents)
    out = decode_record(record, "/c/.metadata").storage_meta
    assert type(out) is StorageMeta and out == plain


@pytest.mark.parametrize(("writer_meta", "ranks", "token"), [
    (JsonRecordStorageMeta(), 2, True),
    (JsonRecordStorageMeta(), 1, False),  # one rank: DCP's broadcast sends nothing
    (StorageMeta(), 2, False),  # a stock writer may pickle the Metadata as its record
    (None, 2, False),
])
def test_the_token_is_sent_only_with_a_dcp_plus_writer_and_more_than_one_rank(
    writer_meta: StorageMeta | None, ranks: int, token: bool
) -> None:
    planner = CachedSavePlanner()
    for _ in range(2):  # a miss, then a hit
        planner.set_up_planner(_sd(3), writer_meta, is_coordinator=True)
        local = planner.create_local_plan()
        replies, md = planner.create_global_plan([local] * ranks)
        planner.finish_plan(replies[0])
        assert (b"_expand_metadata" in pickle.dumps(md)) is token
        assert type(pickle.loads(pickle.dumps(md))) is Metadata
    assert planner.last_was_hit


def test_pickled_planner_carries_no_state_and_finds_its_cache(tmp_path: Path) -> None:
    sd, planner = _sd(200), CachedSavePlanner(cache_size=3)
    _save(sd, tmp_path / "0", planner)
    blob = pickle.dumps(planner)
    assert len(blob) < 1024
    clone = pickle.loads(blob)
    assert clone.cache is planner.cache and clone.cache_size == 3
    _save(sd, tmp_path / "1", clone)
    assert clone.last_was_hit


class _FailOnce(FileSystemWriter):
    failed = True

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not _FailOnce.failed:
            _FailOnce.failed = True
            raise OSError("injected")
        return super().prepare_global_plan(plans)


def test_a_save_that_fails_in_planning_drops_the_cache(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner, _FailOnce(tmp_path / "0"))
    _save(sd, tmp_path / "1", planner, _FailOnce(tmp_path / "1"))
    with pytest.raises(CheckpointException):
        _FailOnce.failed = False
        _save(sd, tmp_path / "2", planner, _FailOnce(tmp_path / "2"))
    _save(sd, tmp_path / "3", planner, _FailOnce(tmp_path / "3"))
    assert not planner.last_was_hit
    _save(sd, tmp_path / "4", planner, _FailOnce(tmp_path / "4"))
    assert planner.last_was_hit


def test_a_hit_compares_the_structure_and_hashes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd, planner = _sd(50), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    hashed: list[int] = []
    real = cached_save.digest_entries
    monkeypatch.setattr(cached_save, "digest_entries",
                        lambda *a: hashed.append(1) or real(*a))
    _save(sd, tmp_path / "1", planner)
    assert planner.last_was_hit and hashed == []
    sd["model"]["w0"] = sd["model"]["w0"].double()
    _save(sd, tmp_path / "2", planner)
    assert not planner.last_was_hit and hashed == [1]


def test_a_one_pass_flatten_that_disagrees_with_dcp_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = cached_save.flatten_with_entries

    def reversed_order(state_dict: Any) -> Flat | None:
        flat = real(state_dict)
        assert flat is not None
        flat.state_dict = dict(reversed(flat.state_dict.items()))
        return flat

    monkeypatch.setattr(cached_save, "flatten_with_entries", reversed_order)
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    assert not planner._fast_flatten
    _save(sd, tmp_path / "1", planner)
    assert planner.last_was_hit
    out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "1"), no_dist=True)
    assert all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())


def test_the_planner_does_not_keep_a_saves_metadata(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    for i in range(2):
        _save(sd, tmp_path / str(i), planner)
        gc.collect()
        assert planner.metadata is None


def test_cache_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cache_size"):
        CachedSavePlanner(cache_size=0)


def _rebuilt(obj: Any) -> Any:
    """The same structure and leaves in new containers (what ``get_state_dict`` returns)."""
    if isinstance(obj, Mapping):
        return type(obj)((k, _rebuilt(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_rebuilt(v) for v in obj]
    return obj


@pytest.mark.parametrize("case", range(4))
def test_a_replay_flattens_a_rebuilt_state_dict_like_dcp(case: int) -> None:
    flat = flatten_with_entries(_nested(case))
    assert flat is not None and flat.template is not None
    sd = _rebuilt(_nested(case))
    again = flat.template.replay(sd)
    assert again is not None
    ref, mappings = flatten_state_dict(sd)
    assert list(again.state_dict) == list(ref) and again.mappings == mappings
    assert all(a is b for a, b in zip(again.state_dict.values(), ref.values(), strict=True))
    assert again.entries == flat.entries


def _changes() -> list[tuple[str, Any]]:
    t = torch.ones(2)
    return [
        ("key renamed", lambda sd: sd["a"].__setitem__("B", sd["a"].pop("b"))),
        ("key added", lambda sd: sd["a"].__setitem__("q", t)),
        ("leaf became a mapping", lambda sd: sd.__setitem__("s", {"x": t})),
        ("terminal list got a tensor", lambda sd: sd["d"].__setitem__(0, t)),
        ("tensor became an int", lambda sd: sd["a"].__setitem__("b", 7)),
        ("dtype", lambda sd: sd["a"].__setitem__("b", t.double())),
        ("shape", lambda sd: sd["a"].__setitem__("b", torch.ones(3))),
        ("requires_grad", lambda sd: sd["a"]["p"].requires_grad_(False)),
        ("key order", lambda sd: sd.__setitem__("a", dict(reversed(sd["a"].items())))),
    ]


@pytest.mark.parametrize("name", [n for n, _ in _changes()])
def test_a_replay_refuses_a_changed_structure(name: str) -> None:
    sd = _nested(0)
    flat = flatten_with_entries(sd)
    assert flat is not None and flat.template is not None
    changed = _rebuilt(sd)
    changed["a"]["p"] = torch.nn.Parameter(torch.zeros(3))
    dict(_changes())[name](changed)
    assert flat.template.replay(changed) is None
    fresh = flatten_with_entries(changed)
    assert fresh is not None and fresh.entries != flat.entries


def test_a_hit_on_a_rebuilt_state_dict_is_a_replay(tmp_path: Path) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    assert planner.cache.replays == 0
    _save(_rebuilt(sd), tmp_path / "1", planner)
    assert planner.last_was_hit and planner.cache.replays == 1
    sd["model"]["w0"] = sd["model"]["w0"].double()
    _save(_rebuilt(sd), tmp_path / "2", planner)
    assert not planner.last_was_hit and planner.cache.replays == 1


def test_a_new_container_type_is_not_replayed_but_the_structure_still_hits(
    tmp_path: Path,
) -> None:
    sd, planner = _sd(), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    template = planner.cache.structures[0][2]
    assert template is not None
    od = {**sd, "model": OrderedDict(sd["model"])}
    assert template.replay(od) is None  # DCP flattens it the same: the entries match
    _save(od, tmp_path / "1", planner)
    assert planner.last_was_hit
    assert planner.cache.structures[0][2] is not template  # replays OrderedDicts next time
    assert planner.cache.structures[0][2].replay(od) is not None


class _StrEnum(str, enum.Enum):
    A = "a"  # == "a", but str() (DCP's key name) is "_StrEnum.A" on Python 3.11


@pytest.mark.parametrize(
    ("recorded", "new"),
    [(1, True), ("a", _StrEnum.A), (0.0, -0.0)],
    ids=["int-bool", "str-enum", "zero-negative-zero"],
)
def test_a_replay_refuses_an_equal_key_with_another_name(recorded: Any, new: Any) -> None:
    t = torch.ones(1)
    flat = flatten_with_entries({"state": {recorded: t}})
    assert flat is not None and flat.template is not None
    assert recorded == new and str(recorded) != str(new)
    assert flat.template.replay({"state": {recorded: t}}) is not None
    assert flat.template.replay({"state": {new: t}}) is None
    assert list(flatten_state_dict({"state": {new: t}})[0]) == [f"state.{new}"]


def test_a_replay_of_tensor_keys_does_not_raise() -> None:
    t, k1, k2 = torch.ones(1), torch.arange(2), torch.arange(2) + 1
    flat = flatten_with_entries({"m": {k1: t}})
    assert flat is not None and flat.template is not None
    assert flat.template.replay({"m": {k1: t}}) is not None
    assert flat.template.replay({"m": {k2: t}}) is None


def test_a_non_terminal_list_that_became_terminal_is_not_replayed() -> None:
    t = torch.ones(1)
    flat = flatten_with_entries({"l": [t, 1]})
    assert flat is not None and flat.template is not None
    # DCP saves [2, 1] as one value, not as l.0 and l.1
    assert flat.template.replay({"l": [2, 1]}) is None
    assert list(flatten_state_dict({"l": [2, 1]})[0]) == ["l"]


def test_the_coordinator_keeps_local_plans_pickled_and_one_structure_metadata(
    tmp_path: Path,
) -> None:
    sd, planner = _sd(20), CachedSavePlanner()
    _save(sd, tmp_path / "0", planner)
    cache = planner.cache
    (key,) = cache.mirror[0].keys()
    assert isinstance(cache.mirror[0].peek(key), bytes)  # one untracked object, not a dataclass per item
    plan = cache.mirrored_plan(0, key)
    assert plan is not None and len(plan.items) == 21  # 20 tensors and "step"
    (final_key,) = cache.finals.keys()
    (global_key,) = cache.globals.keys()
    final = cache.finals.peek(final_key)
    entry = cache.globals.peek(global_key)
    assert final is not None and entry is not None and entry.metadata is final[1]


class _CountsPickles:
    pickled = 0

    def __init__(self, payload: str) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Any, ...]:
        _CountsPickles.pickled += 1
        return (_CountsPickles, (self.payload,))


def test_every_reply_shares_one_pickle_of_the_structure_metadata() -> None:
    from dcp_plus.planners.cache import CachePlan, PickledOnce

    _CountsPickles.pickled = 0
    shared = PickledOnce(_CountsPickles("structure"))
    replies = [CachePlan([], key=b"k", metadata=shared) for _ in range(8)]
    received = [pickle.loads(pickle.dumps(r)) for r in replies]  # DCP's scatter, per rank
    assert _CountsPickles.pickled == 1
    assert all(r.structure().payload == "structure" for r in received)  # type: ignore[union-attr]
    assert replies[0].structure() is shared.value  # not pickled at all (no_dist)


def test_a_local_plan_travels_as_its_own_pickle_and_only_an_unpickled_one_keeps_the_bytes(
) -> None:
    import copy

    from dcp_plus.planners.cache import FULL, LocalCachePlan, plain_plan

    planner = CachedSavePlanner()
    planner.set_up_planner(_sd(6), is_coordinator=True)
    local = planner.create_local_plan()
    assert type(local) is LocalCachePlan and local.kind == FULL and len(local.items) == 7
    # Unpickled (as by DCP's gather), the plan keeps the bytes it was rebuilt from: they
    # unpickle to an equal plan, so the coordinator can mirror them as they are.
    received = pickle.loads(pickle.dumps(local))
    kept = received.received_pickle()
    assert kept is not None and pickle.loads(kept) == plain_plan(local, storage_data=None)
    # A copy keeps no bytes, so a copy whose items are edited afterwards can never be
    # mirrored from stale bytes.
    for other in (received, copy.deepcopy(local), copy.copy(local), copy.deepcopy(received),
                  copy.copy(received)):
        assert type(other) is LocalCachePlan
        assert plain_plan(other) == plain_plan(local) and other.key == local.key
    for other in (copy.deepcopy(local), copy.copy(local), copy.deepcopy(received),
                  copy.copy(received)):
        assert other.received_pickle() is None
    assert copy.copy(local).items is local.items  # shallow, as for any dataclass
    assert local.received_pickle() is None
    # (the 2-rank test in tests/dist/test_cached_planner.py checks that the coordinator
    # stores the bytes DCP's real gather received and pickles nothing in commit())


def test_hits_hand_the_writer_their_structures_record_memo(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """Every save of one cache entry carries the same memo, so the columnar record reuses
    its structure's encoding; the records stay what a planner without a memo writes."""
    import dcp_plus.format.record as record_module
    from dcp_plus import LocalReader, LocalWriter, SafeLoadPlanner
    from dcp_plus.format.record_memo import record_memo

    monkeypatch.setattr(record_module, "COLUMNAR_MIN_ITEMS", 1)
    planner, memos = CachedSavePlanner(), []
    for step in range(3):
        sd = _sd()
        sd["model"]["w1"].add_(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            md = dcp.save(sd, storage_writer=LocalWriter(tmp_path / f"s{step}"),
                          planner=planner, no_dist=True)
            dcp.save(sd, storage_writer=LocalWriter(tmp_path / f"plain{step}"), no_dist=True)
        memos.append(record_memo(md))
        got = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(got, storage_reader=LocalReader(tmp_path / f"s{step}"),
                     planner=SafeLoadPlanner(), no_dist=True)
        assert got["step"] == 3 and all(torch.equal(got["model"][k], v)
                                        for k, v in sd["model"].items())
        ours, plain = (json.loads((tmp_path / f"{n}{step}" / ".metadata").read_bytes())
                       for n in ("s", "plain"))
        for r in (ours, plain):
            del r["storage_meta"], r["record_checksum"]
            r["files"] = [f.split(".")[0] for f in r["files"]]  # save ids differ
        assert ours == plain
    assert memos[0] is not None and memos[0] is memos[1] is memos[2]
    assert not isinstance(pickle.loads(pickle.dumps(md)), CachedMetadata)
