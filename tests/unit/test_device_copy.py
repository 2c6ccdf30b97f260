"""GPU-mode snapshots, the parts that run without a GPU: the mirror's layout, CheckFreq's
memory test, option checking, the byte copies, and the host path it falls back to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import CachedSavePlanner, LocalWriter
from dcp_plus.schedule import AdaptiveInterval, SaveStats
from dcp_plus.stagers import ArenaStager
from dcp_plus.stagers.arena import fingerprint, plan_layout
from dcp_plus.stagers.copy_engine import copy_bytes
from dcp_plus.stagers.device_copy import (
    DeviceCopyPolicy,
    DeviceMemory,
    check_device_copy,
    fits,
    plan_mirror,
)
from tests.conftest import DTYPES, assert_bit_exact, load, random_tensor

MiB = 1 << 20


def _extents(spec: list[tuple[int, bool]]) -> tuple[list[object], list[bool]]:
    """A layout of tensors of ``nbytes`` each, and which are on the device."""
    fp = tuple((f"t{i}", torch.uint8, (n,), (1,), "cuda:0" if dev else "cpu")
               for i, (n, dev) in enumerate(spec))
    layout = plan_layout(fp, slab_bytes=64 * 1024)
    return list(layout.extents), [dev for _, dev in spec]


def test_mirror_runs_merge_consecutive_device_extents_across_padding():
    extents, dev = _extents([(100, True), (5000, True), (1, True)])
    plan = plan_mirror(extents, dev)
    # at 0, 4096 and 12288: one copy, the padding between extents included
    assert plan.runs == ((0, 0, 12288 + 1),)
    assert plan.bounds == {0: (0, 12289)}
    assert plan.nbytes == 12289


def test_a_cpu_tensor_splits_a_run_and_an_empty_one_does_not():
    extents, dev = _extents([(10, True), (4, False), (10, True), (0, False), (10, True)])
    plan = plan_mirror(extents, dev)
    assert plan.runs == ((0, 0, 10), (0, 8192, 4096 * 4 + 10))
    assert plan.bounds[0] == (0, 4096 * 4 + 10)


def test_mirror_plan_spans_slabs_and_skips_empty_device_tensors():
    extents, dev = _extents([(40_000, True), (40_000, True), (0, True), (8, False)])
    plan = plan_mirror(extents, dev)
    assert [s for s, *_ in plan.runs] == [0, 1]  # one run per slab
    assert plan.nbytes == 80_000
    cpu_only = plan_mirror(*_extents([(8, False)]))
    assert cpu_only.runs == () and cpu_only.nbytes == 0


def test_checkfreq_memory_test():
    # 10 GiB spare, training grows back by 4, the mirror takes 5: 1 GiB left
    g = 1 << 30
    assert fits(10 * g, 4 * g, 5 * g, 1 * g)
    assert not fits(10 * g, 4 * g, 5 * g + 1, 1 * g)
    assert fits(10 * g, -3, 9 * g, 1 * g)  # a negative growth counts as none
    mem = DeviceMemory(free=6 * g, total=80 * g, reserved=20 * g, allocated=16 * g,
                       peak_allocated=19 * g)
    assert mem.spare == 10 * g and mem.growth == 3 * g
    policy = DeviceCopyPolicy("auto")
    assert policy.margin(mem) == 4 * g  # 5 % of 80 GiB
    assert policy.margin(DeviceMemory(0, 8 * g, 0, 0, 0)) == 1 * g  # at least 1 GiB
    assert DeviceCopyPolicy("auto", margin_bytes=0).margin(mem) == 0


@pytest.mark.parametrize("bad", ["yes", True, None, "AUTO"])
def test_device_copy_mode_is_checked(bad):
    with pytest.raises(ValueError, match="device_copy=.*'auto', 'always', 'never'"):
        check_device_copy(bad)
    with pytest.raises(ValueError, match="device_copy"):
        ArenaStager(device_copy=bad)


def test_negative_margin_is_refused():
    with pytest.raises(ValueError, match="device_margin_bytes=.*>= 0, got -1"):
        ArenaStager(device_margin_bytes=-1)


def test_never_and_always_decide_without_reading_device_memory():
    plan = plan_mirror(*_extents([(8, True)]))
    never, always = DeviceCopyPolicy("never"), DeviceCopyPolicy("always")
    assert not never.choose(plan, None, 0) and "never" in never.reason
    assert always.choose(plan, None, 0) and "always" in always.reason


def test_copy_bytes_is_bit_exact_for_every_dtype_and_layout():
    gen = torch.Generator().manual_seed(3)
    pairs, expected = [], []
    for dt in DTYPES:
        for shape in [(), (0,), (5, 7), (4097,)]:
            src = random_tensor(shape, dt, gen)
            pairs.append((src, torch.empty_like(src)))
            expected.append(src)
        t = random_tensor((6, 5), dt, gen).t()  # not contiguous: the typed copy
        pairs.append((t, torch.empty(t.shape, dtype=dt)))
        expected.append(t)
    copy_bytes(pairs)
    for (_, dst), src in zip(pairs, expected, strict=True):
        assert_bit_exact(dst, src)


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_cpu_state_dicts_stage_through_host_memory_in_every_mode(mode, tmp_path):
    gen = torch.Generator().manual_seed(0)
    sd = {f"t{i}": random_tensor((257,), dt, gen) for i, dt in enumerate(DTYPES)}
    expected = {k: v.clone() for k, v in sd.items()}
    with ArenaStager(device_copy=mode) as stager:
        resp = dcp.async_save(sd, storage_writer=LocalWriter(tmp_path / "c"),
                              planner=CachedSavePlanner(), async_stager=stager, no_dist=True)
        stager.synchronize_staging()
        resp.upload_completion.result()
        status = stager.device_copy_status
        assert status.mode == mode
        assert status.held_bytes == 0 and status.last_device_copy_s is None
    assert_bit_exact(load({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "c"),
                     expected)


def test_arena_marks_which_extents_a_mirror_would_hold():
    fp = fingerprint(["a", "b"], [torch.zeros(3), torch.zeros(2, dtype=torch.int64)])
    from dcp_plus.stagers.arena import Arena

    arena = Arena(fp, plan_layout(fp, MiB), pin=False)
    assert arena.on_device == [False, False] and arena.cuda_device is None
    assert arena.mirror_plan.nbytes == 0 and arena.mirror is None
    fp = (("a", torch.float32, (3,), (1,), "cuda:1"), ("b", torch.float32, (3,), (1,), "cpu"))
    arena = Arena(fp, plan_layout(fp, MiB), pin=False)
    assert arena.on_device == [True, False] and arena.cuda_device == 1
    assert arena.mirror_plan.nbytes == 12
    fp = (("a", torch.float32, (3,), (1,), "cuda:1"), ("b", torch.float32, (3,), (1,), "cuda:0"))
    assert Arena(fp, plan_layout(fp, MiB), pin=False).cuda_device is None


def test_adaptive_interval_keeps_gpu_mode_copy_times():
    policy = AdaptiveInterval(0.05, warmup=1, profile_saves=1)
    policy.observe_iteration(0.5)
    assert policy.should_save(1)
    policy.observe_save(SaveStats(step=1, blocking_s=0.002, waited_s=0.0,
                                  exposed_staging_s=0.003, staging_s=0.4, persist_s=2.0,
                                  device_copy_s=0.003))
    assert policy.tg.value == pytest.approx(0.003)
    assert "Tg=3.0ms" in policy.decisions[-1].describe()


def test_gpu_mode_copies_the_mirror_into_the_slabs_and_releases_the_live_tensors_first():
    """The GPU-mode plumbing with CPU stand-ins for the device: which bytes go where."""
    import threading

    from dcp_plus.stagers.arena import Arena
    from dcp_plus.stagers.copy_engine import copy_bytes
    from dcp_plus.stagers.snapshot import Snapshotter

    fp = (("a", torch.uint8, (10,), (1,), "cuda:0"), ("b", torch.float32, (3,), (1,), "cpu"),
          ("c", torch.int16, (5,), (1,), "cuda:0"))
    arena = Arena(fp, plan_layout(fp, MiB), pin=False)
    buf = arena.add_buffer()
    try:
        plan = arena.mirror_plan
        backing = {s: torch.randint(0, 256, (hi,), dtype=torch.uint8)
                   for s, (_lo, hi) in plan.bounds.items()}
        views = [backing[e.slab][e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
                 if dev else None for e, dev in zip(arena.layout.extents, arena.on_device, strict=True)]
        mirror = SimpleNamespace(device=0, views=views,
                                 bytes_of=lambda s, a, b: backing[s][a:b])
        order: list[str] = []

        class Engine:
            def copy_through_mirror(self, m, to_mirror, cpu, to_host, events, released):
                copy_bytes(to_mirror)
                copy_bytes(cpu)
                released(0.004)
                order.append("released")
                copy_bytes(to_host)
                order.append("on host")

        holds = SimpleNamespace(reading=1)
        snap = Snapshotter(threading.Condition(), None, None, None, holds, Engine(),  # type: ignore[arg-type]
                           DeviceCopyPolicy("always"))
        job = SimpleNamespace(reading=True, events={})
        live = [torch.full((10,), 7, dtype=torch.uint8), torch.tensor([1.5, -2.0, 3.25]),
                torch.arange(5, dtype=torch.int16)]
        seconds = snap._copy_through(mirror, arena, buf, ["a", "b", "c"], live, frozenset(),
                                     job)  # type: ignore[arg-type]
        assert seconds == 0.004 and order == ["released", "on host"]
        assert job.reading is False and holds.reading == 0  # the guard may go on
        for view, src in zip(buf.views, live, strict=True):  # the slabs hold the snapshot
            assert_bit_exact(view, src)
    finally:
        arena.free()
