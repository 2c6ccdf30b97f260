"""Invariant 1: what DCP saves through LocalWriter loads back through LocalReader bit-exact."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from dcp_plus import LocalReader, LocalWriter
from dcp_plus.errors import CheckpointFormatError
from tests.conftest import (
    assert_bit_exact,
    carve,
    clone_state,
    data_files,
    fill_pattern,
    load,
    load_target,
    read_record_json,
    registered_slab,
    save,
    slab_state_dict,
    worker_pids,
)
from tools.testkit.world import single_rank_world


@pytest.fixture(scope="module")
def gloo_single_rank() -> Iterator[None]:
    """A 1-rank gloo group: ``async_save`` with the PROCESS executor needs an initialized one."""
    with single_rank_world():
        yield


@pytest.mark.parametrize("threads", [1, 3])
def test_save_then_load_is_bit_exact_for_every_kind_of_value(tmp_path, state_dict, threads):
    expected = clone_state(state_dict)
    save(state_dict, tmp_path / "ckpt", threads=threads)

    loaded = load(load_target(state_dict), tmp_path / "ckpt")

    assert_bit_exact(loaded, expected)
    assert read_record_json(tmp_path / "ckpt")["format"] == "dcp_plus"


def test_load_without_verification_is_bit_exact(tmp_path, state_dict):
    save(state_dict, tmp_path / "ckpt")

    loaded = load(load_target(state_dict), tmp_path / "ckpt", verify=False, threads=1)

    assert_bit_exact(loaded, state_dict)


def test_loading_a_subset_of_keys_reads_only_those(tmp_path, state_dict):
    save(state_dict, tmp_path / "ckpt")
    subset = {"dtypes": {"bfloat16": torch.zeros(3, 5, dtype=torch.bfloat16)},
              "transposed": torch.zeros(6, 8).t(), "step": 0}

    loaded = load(subset, tmp_path / "ckpt")

    assert_bit_exact(loaded, {"dtypes": {"bfloat16": state_dict["dtypes"]["bfloat16"]},
                              "transposed": state_dict["transposed"], "step": 1234})


@pytest.mark.parametrize("executor", [AsyncCheckpointerType.THREAD,
                                      AsyncCheckpointerType.PROCESS], ids=lambda e: e.value)
def test_async_save_is_bit_exact_with_the_state_at_the_call(tmp_path, state_dict, executor,
                                                            request):
    # THREAD runs without torch.distributed; PROCESS needs an initialized group (its daemon
    # joins one built from the caller's)
    process = executor == AsyncCheckpointerType.PROCESS
    if process:
        request.getfixturevalue("gloo_single_rank")
    expected = clone_state(state_dict)

    result = dcp.async_save(state_dict, storage_writer=LocalWriter(tmp_path / "ckpt"),
                            async_checkpointer_type=executor, no_dist=not process)
    # training continues while the upload runs: the checkpoint must not see this
    with torch.no_grad():
        state_dict["dtypes"]["float32"].add_(1.0)
        state_dict["shared"]["whole"].zero_()
    upload = getattr(result, "upload_completion", result)
    upload.result(timeout=120)

    loaded = load(load_target(expected), tmp_path / "ckpt")
    assert_bit_exact(loaded, expected)


def test_slab_tensors_are_written_by_worker_processes_as_the_slab_image(tmp_path, slab):
    sd, offsets = slab_state_dict(slab)
    sd_plain = {**sd, "plain": torch.arange(10, dtype=torch.int16)}
    expected = clone_state(sd_plain)
    assert worker_pids() == []

    save(sd_plain, tmp_path / "ckpt")

    pids = worker_pids()
    assert len(pids) == 2 and os.getpid() not in pids, pids
    extents = {e["fqn"]: e for e in read_record_json(tmp_path / "ckpt")["extents"]}
    slab_file = extents["w_f32"]["file"]
    assert extents["plain"]["file"] != slab_file
    image = (tmp_path / "ckpt" / slab_file).read_bytes()
    whole = bytes(slab.buffer)
    for name, off in offsets.items():
        ext = extents[name]
        assert ext["file"] == slab_file, name
        assert ext["offset"] % 4096 == 0, name  # the format's alignment, whatever the slab's
        at = ext["offset"]
        assert image[at : at + ext["length"]] == whole[off : off + ext["length"]], name
    del image, whole

    loaded = load(load_target(expected), tmp_path / "ckpt")
    assert_bit_exact(loaded, expected)


def test_workers_are_reused_by_later_saves(tmp_path, slab):
    sd, _ = slab_state_dict(slab)
    save(sd, tmp_path / "a")
    first = worker_pids()

    save(sd, tmp_path / "b")

    assert worker_pids() == first and len(first) == 2
    assert_bit_exact(load(load_target(sd), tmp_path / "b"), clone_state(sd))


def test_large_slab_file_split_across_workers_round_trips(tmp_path):
    # > 2 x 64 MiB: the slab is written as two contiguous files by different workers (never
    # one file shared by two writers), and the reader batches them in 64 MiB pieces
    with registered_slab(136 << 20) as big:
        st = big.tensor()
        fill_pattern(st, seed=5)
        sd = carve(st, "t", pieces=8)  # 17 MiB each, dtypes rotate
        del st
        save(sd, tmp_path / "ckpt", fsync=False)

        names = sorted(data_files(tmp_path / "ckpt"))
        assert len(names) == 2
        sizes = [os.path.getsize(tmp_path / "ckpt" / n) for n in names]
        assert sum(sizes) == 136 << 20 and min(sizes) >= 64 << 20
        assert set(worker_pids()) and len({e["file"] for e in read_record_json(
            tmp_path / "ckpt")["extents"]}) == 2
        loaded = load({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "ckpt")
        assert_bit_exact(loaded, sd)
        del sd, loaded


def test_commit_record_is_json_that_rebuilds_dcp_metadata(tmp_path, state_dict):
    save(state_dict, tmp_path / "ckpt")

    raw = (tmp_path / "ckpt" / ".metadata").read_bytes()

    assert raw[:1] == b"{" and b"\x80" not in raw[:2]
    md = LocalReader(tmp_path / "ckpt").read_metadata()
    assert md.state_dict_metadata["dtypes.bfloat16"].properties.dtype == torch.bfloat16
    assert md.state_dict_metadata["param"].properties.requires_grad is True


def test_record_carries_the_save_id_of_its_data_files(tmp_path):
    writer = LocalWriter(tmp_path / "first")
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, no_dist=True)
    # a writer reused for the next checkpoint, redirected by checkpoint_id
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=tmp_path / "second", storage_writer=writer,
             no_dist=True)

    for name, value in [("first", 1.0), ("second", 0.0)]:
        rec = read_record_json(tmp_path / name)
        save_ids = {f.split(".")[1] for f in data_files(tmp_path / name)}
        assert save_ids == {rec["storage_meta"]["save_id"]}, (save_ids, rec["storage_meta"])
        assert rec["storage_meta"]["checkpoint_id"] == str(tmp_path / name)
        assert isinstance(rec["dcp_version"], str)
        md = LocalReader(tmp_path / name).read_metadata()
        assert md.storage_meta.save_id == rec["storage_meta"]["save_id"]
        assert_bit_exact(load({"w": torch.empty(3)}, tmp_path / name), {"w": torch.full((3,), value)})


def test_save_without_collectives_is_refused(tmp_path):
    # without collectives every rank would commit a record of only its own items
    with pytest.raises(CheckpointFormatError, match="use_collectives=True"):
        dcp.save({"w": torch.ones(3)}, storage_writer=LocalWriter(tmp_path / "ckpt"),
                 no_dist=True, use_collectives=False)

    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_load_into_other_dtypes_converts_like_stock_dcp(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter

    src = {"w": torch.randn(4, 3), "i": torch.arange(5), "t": torch.randn(3, 4).t()}
    save(src, tmp_path / "ours")
    dcp.save(src, storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)

    def target() -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(4, 3, dtype=torch.bfloat16),
                "i": torch.zeros(5, dtype=torch.float64),
                "t": torch.zeros(3, 4, dtype=torch.float16).t()}

    ours = load(target(), tmp_path / "ours")
    stock = load(target(), tmp_path / "stock", allow_pickle=True)
    assert_bit_exact(ours, stock)
    assert_bit_exact(ours["w"], src["w"].bfloat16())
