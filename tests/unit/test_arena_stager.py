"""ArenaStager: snapshots are consistent, fresh, reused, bounded and cleaned up."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import threading
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from dcp_plus import LocalReader, LocalWriter
from dcp_plus._compat.torch_dcp import flatten_state_dict
from dcp_plus.errors import CapacityError, ClosedError, StagingError
from dcp_plus.format.layout import ALIGNMENT
from dcp_plus.memory.slabs import SHM_DIR, registry
from dcp_plus.stagers import ArenaStager
from dcp_plus.stagers.staged import StagedStateDict, attached_slab_names

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]


def _model(width: int = 64, depth: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, model[0].in_features)).square().sum().backward()
    opt.step()


def _clone(sd: dict) -> dict:
    out: dict = {}
    for k, v in sd.items():
        out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _flat(sd: dict) -> dict:
    return flatten_state_dict(sd)[0]


def _load_model_sd(path: str, like: dict) -> dict:
    target = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    dcp.load(target, checkpoint_id=path)
    return target["model"]


def _my_segments() -> set[str]:
    prefix = f"dcpp-{os.getpid()}-"
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def stager():
    s = ArenaStager()
    yield s
    s.close(timeout=10)


# -- protocol -----------------------------------------------------------------------------


def test_is_an_async_stager_and_async_save_returns_a_response(stager, tmp_path):
    model, _ = _model()
    assert isinstance(stager, AsyncStager)
    assert stager.should_synchronize_after_execute is False
    resp = dcp.async_save(
        {"model": model.state_dict()},
        storage_writer=dcp.FileSystemWriter(str(tmp_path)),
        async_stager=stager,
    )
    assert type(resp).__name__ == "AsyncSaveResponse"
    resp.staging_completion.result()
    resp.upload_completion.result()
    loaded = _load_model_sd(str(tmp_path), model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_stage_returns_a_future_of_a_copy_never_aliasing_live_storage(stager):
    live = {"w": torch.randn(1000), "b": torch.randn(10)}
    fut = stager.stage(live)
    assert isinstance(fut, Future)
    staged = fut.result()
    assert isinstance(staged, StagedStateDict)
    for k in live:
        assert torch.equal(staged[k], live[k])
        assert staged[k].data_ptr() != live[k].data_ptr()
        assert registry.lookup(staged[k]) is not None


def test_non_tensor_leaves_are_deep_copied_at_stage_time(stager):
    extra = {"lrs": [0.1, 0.2], "name": "run"}
    live = {"w": torch.ones(4), "extra": extra}
    fut = stager.stage(live)
    extra["lrs"].append(0.3)
    extra["name"] = "other"
    staged = fut.result()
    assert staged["extra"] == {"lrs": [0.1, 0.2], "name": "run"}


# -- consistency --------------------------------------------------------------------------


def test_with_guard_checkpoint_equals_live_values_at_stage_time(tmp_path):
    model = torch.nn.Linear(2048, 4096)  # 32 MiB of weights: copying takes a while
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    with ArenaStager() as stager:
        stager.guard(opt)
        expected = _clone(model.state_dict())
        resp = dcp.async_save(
            {"model": model.state_dict()},
            storage_writer=dcp.FileSystemWriter(str(tmp_path)),
            async_stager=stager,
        )
        opt.step()  # changes every parameter right after stage() returned
        resp.upload_completion.result()
    assert not torch.equal(model.weight, expected["weight"])
    loaded = _load_model_sd(str(tmp_path), expected)
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


def test_without_guard_or_wait_the_snapshot_can_be_torn():
    """Proves the guard matters: mutate right after stage() with no wait."""
    live = torch.zeros(16 << 20)
    with ArenaStager() as stager:
        # Hold the copy thread (jobs run in submission order) until the mutation is done, so
        # the outcome does not depend on who wins a race: stage() returned before any copy.
        held = threading.Event()
        stager._engine.submit(held.wait)
        fut = stager.stage({"w": live})
        live.fill_(1.0)  # no guard, no wait on staging_completion
        held.set()
        staged = fut.result()["w"]
        assert bool((staged == 1.0).any()), "mutation after stage() did not reach the snapshot"
        del staged, fut


def test_synchronize_staging_reraises_a_staging_error_once():
    with ArenaStager(max_bytes=1 << 20) as stager:
        fut = stager.stage({"w": torch.zeros(1 << 20)})  # 4 MiB > 1 MiB
        with pytest.raises(CapacityError, match="max_bytes=1048576"):
            stager.synchronize_staging()
        stager.synchronize_staging()  # cleared
        with pytest.raises(CapacityError):
            fut.result()
        assert stager.stage({"w": torch.zeros(16)}).result()["w"].numel() == 16


def test_guard_handle_removes_the_hook(stager):
    model, opt = _model()
    handle = stager.guard([opt])
    assert len(opt._optimizer_step_pre_hooks) == 1
    handle.remove()
    assert len(opt._optimizer_step_pre_hooks) == 0


# -- freshness and reallocation -----------------------------------------------------------


def test_checkpoint_n_plus_1_equals_step_n_plus_1_values(stager, tmp_path):
    model, opt = _model()
    stager.guard(opt)
    snapshots = []
    for step in range(3):
        snapshots.append(_clone(model.state_dict()))
        resp = dcp.async_save(
            {"model": model.state_dict()},
            storage_writer=dcp.FileSystemWriter(str(tmp_path / str(step))),
            async_stager=stager,
        )
        _train_step(model, opt)
        resp.upload_completion.result()
    assert len(stager.slab_names()) == 1  # one arena buffer, reused
    for step, expected in enumerate(snapshots):
        loaded = _load_model_sd(str(tmp_path / str(step)), expected)
        for k, v in expected.items():
            assert torch.equal(loaded[k], v), (step, k)
        if step:
            assert not torch.equal(loaded["0.weight"], snapshots[step - 1]["0.weight"])


@pytest.mark.parametrize(
    "change",
    [
        lambda sd: {**sd, "new": torch.ones(3)},
        lambda sd: {**sd, "w": sd["w"].to(torch.bfloat16)},
        lambda sd: {**sd, "w": sd["w"].reshape(8, 2)},
    ],
    ids=["new-parameter", "dtype-change", "reshape"],
)
def test_structure_change_reallocates_and_frees_the_old_arena(stager, change):
    sd = {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4), "b": torch.ones(2)}
    stager.stage(sd).result()
    before = set(stager.slab_names())
    stager.stage(sd).result()
    assert set(stager.slab_names()) == before  # same structure: reused
    changed = change(sd)
    staged = stager.stage(changed).result()
    after = set(stager.slab_names())
    assert after and not after & before
    assert not before & _my_segments()  # the old arena's segments are gone
    for k, v in changed.items():
        assert staged[k].dtype == v.dtype and torch.equal(staged[k], v)


def test_extents_are_aligned_in_flattened_state_dict_order(stager):
    sd = {
        "model": {"a": torch.ones(3), "b": torch.ones(5000, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"exp_avg": torch.ones(7)}}, "param_groups": [{"lr": 0.1}]},
        "step": 3,
    }
    staged = stager.stage(sd).result()
    refs = [registry.lookup(v) for v in _flat(staged).values() if isinstance(v, torch.Tensor)]
    assert all(r is not None for r in refs)
    assert len({r.slab for r in refs}) == 1
    offsets = [r.offset for r in refs]
    assert offsets == sorted(offsets) and all(o % ALIGNMENT == 0 for o in offsets)


def test_ten_thousand_tensors_use_a_few_slabs_and_no_fd_per_tensor(stager):
    sd = {f"t{i}": torch.full((8,), float(i)) for i in range(10_000)}
    fds = _open_fds()
    staged = stager.stage(sd).result()
    assert len(stager.slab_names()) <= 2
    assert _open_fds() <= fds + 2
    assert torch.equal(staged["t9999"], sd["t9999"])


# -- buffers, bounds ----------------------------------------------------------------------


def test_buffers_1_waits_until_the_previous_snapshot_is_released():
    with ArenaStager(wait_timeout_s=0.2) as stager:
        held = stager.stage({"w": torch.ones(8)}).result()
        with pytest.raises(StagingError, match="no buffer was released"):
            stager.stage({"w": torch.ones(8)})
        del held
        assert torch.equal(stager.stage({"w": torch.ones(8) * 2}).result()["w"], torch.ones(8) * 2)


def test_buffers_2_takes_a_snapshot_while_the_previous_one_persists():
    with ArenaStager(buffers=2, wait_timeout_s=0.2) as stager:
        first = stager.stage({"w": torch.ones(8)}).result()
        second = stager.stage({"w": torch.ones(8) * 2}).result()
        assert torch.equal(first["w"], torch.ones(8))
        assert first["w"].data_ptr() != second["w"].data_ptr()
        with pytest.raises(StagingError):
            stager.stage({"w": torch.ones(8)})
        del first, second


def test_max_bytes_error_names_the_bound_and_the_fix():
    with (
        ArenaStager(max_bytes=8192) as stager,
        pytest.raises(CapacityError, match="raise max_bytes"),
    ):
        stager.stage({"w": torch.zeros(4096)}).result()


# -- lifecycle ----------------------------------------------------------------------------


def test_close_unlinks_segments_joins_threads_and_refuses_further_use():
    threads = threading.active_count()
    with ArenaStager() as stager:
        stager.stage({"w": torch.ones(1024)}).result()
        assert _my_segments()
        assert threading.active_count() > threads
    assert not _my_segments()
    assert threading.active_count() == threads
    with pytest.raises(ClosedError, match="after close"):
        stager.stage({"w": torch.ones(1)})
    with pytest.raises(ClosedError):
        stager.guard(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
    stager.close()  # idempotent


def test_close_waits_for_a_persist_still_reading_the_arena():
    stager = ArenaStager()
    staged = stager.stage({"w": torch.ones(1024)}).result()
    closed = threading.Event()

    def close() -> None:
        stager.close()
        closed.set()

    t = threading.Thread(target=close)
    t.start()
    assert not closed.wait(0.3)  # blocked: the "persist" still holds the staged dict
    assert torch.equal(staged["w"], torch.ones(1024))
    del staged
    t.join(10)
    assert closed.is_set() and not _my_segments()


def test_close_from_the_upload_done_callback_returns(tmp_path):
    # the callback runs on the save's thread, whose arguments still hold the staged dict
    stager = ArenaStager()
    closed = threading.Event()
    resp = dcp.async_save({"w": torch.ones(4096)}, storage_writer=LocalWriter(tmp_path / "c"),
                          async_stager=stager, no_dist=True)
    resp.upload_completion.add_done_callback(lambda _: (stager.close(), closed.set()))
    resp.upload_completion.result(timeout=60)
    assert closed.wait(60) and not _my_segments()


def test_close_with_timeout_frees_names_but_live_views_stay_readable():
    stager = ArenaStager()
    staged = stager.stage({"w": torch.ones(1024)}).result()
    stager.close(timeout=0.1)
    assert not _my_segments()
    assert torch.equal(staged["w"], torch.ones(1024))  # mapping lives as long as the view


def test_release_happens_when_dcp_drops_the_staged_dict(stager, tmp_path):
    model, _ = _model()
    for i in range(2):
        resp = dcp.async_save(
            {"model": model.state_dict()},
            storage_writer=dcp.FileSystemWriter(str(tmp_path / str(i))),
            async_stager=stager,
        )
        resp.upload_completion.result()
        assert stager.wait_persisted(timeout=10)


# -- pickling into DCP's checkpoint process -----------------------------------------------


def test_staged_dict_pickles_as_slab_descriptors_not_bytes(stager):
    sd = {"model": {"w": torch.randn(1 << 18)}, "step": 7, "l": [torch.ones(2), 3]}
    staged = stager.stage(sd).result()
    payload = bytes(ForkingPickler.dumps(staged))
    assert len(payload) < 4096  # 1 MiB of tensor data travels as a name and offsets
    rebuilt = pickle.loads(payload)
    assert type(rebuilt) is dict and rebuilt["step"] == 7
    assert torch.equal(rebuilt["model"]["w"], sd["model"]["w"])
    assert torch.equal(rebuilt["l"][0], torch.ones(2)) and rebuilt["l"][1] == 3
    assert set(attached_slab_names()) & set(stager.slab_names())
    ref = registry.lookup(rebuilt["model"]["w"])
    assert ref is not None and ref.slab in stager.slab_names()
    del rebuilt
    gc.collect()


# -- soak ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_debug_records():
    """No DEBUG/INFO log records created: pytest keeps every record of a test, and DCP logs
    ~26 per async_save (its ``c10d-NullHandler-dcp_logger`` at DEBUG, ~47 KiB), which alone
    is 47 MiB of RSS over 1,000 saves (flat outside pytest, or with ``-p no:logging``)."""
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _soak(cycles: int, tmp_path) -> None:
    model, opt = _model(width=128, depth=4)
    with _no_debug_records(), ArenaStager() as stager:
        stager.guard(opt)

        def cycle(i: int) -> None:
            resp = dcp.async_save(
                {"model": model.state_dict(), "optim": opt.state_dict()},
                storage_writer=dcp.FileSystemWriter(str(tmp_path / str(i % 2))),
                async_stager=stager,
            )
            _train_step(model, opt)
            resp.upload_completion.result()

        for i in range(10):
            cycle(i)
        assert stager.wait_persisted(timeout=10)
        gc.collect()
        base = (_rss_bytes(), _my_segments(), _open_fds(), threading.active_count())
        for i in range(cycles):
            cycle(i)
        assert stager.wait_persisted(timeout=10)
        gc.collect()
        rss, segs, fds, threads = (
            _rss_bytes(),
            _my_segments(),
            _open_fds(),
            threading.active_count(),
        )
    assert segs == base[1]
    assert fds <= base[2]
    assert threads <= base[3]
    assert rss - base[0] < 32 << 20, f"RSS grew by {(rss - base[0]) >> 20} MiB"


def test_200_save_cycles_keep_rss_segments_fds_and_threads_flat(tmp_path):
    _soak(200, tmp_path)


@pytest.mark.slow
def test_1000_save_cycles_keep_rss_segments_fds_and_threads_flat(tmp_path):
    _soak(1000, tmp_path)


# -- pre-faulting -------------------------------------------------------------------------


def test_prefaulted_slabs_become_the_first_arena_and_leftovers_are_freed():
    sd = {"a": torch.randn(300_000), "b": torch.randn(5, 7).to(torch.bfloat16)}
    with ArenaStager() as stager:
        stager.prefault(8 << 20).result()  # more than the arena needs
        pooled = _my_segments()
        assert pooled and stager.nbytes == 8 << 20
        staged = stager.stage(sd).result()
        assert set(stager.slab_names()) <= pooled  # taken from the pool, not made anew
        assert _my_segments() == set(stager.slab_names())  # leftovers unlinked
        assert stager.nbytes == sum(os.path.getsize(f"{SHM_DIR}/{n}") for n in _my_segments())
        assert stager.nbytes < 2 * ALIGNMENT + 300_000 * 4 + 4096
        for k, v in sd.items():
            assert torch.equal(staged[k], v), k
        del staged


def test_guard_prefaults_after_the_first_step_for_the_first_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with ArenaStager() as stager:
        stager.guard(opt)
        assert not _my_segments()
        _train_step(model, opt)  # AdamW's state exists now: the pre-fault starts
        assert stager._prefaulted is not None
        stager._prefaulted.result()
        pooled = _my_segments()
        assert pooled
        expected = _clone(model.state_dict())
        resp = dcp.async_save(
            {"model": model.state_dict(), "optim": opt.state_dict()},
            storage_writer=dcp.FileSystemWriter(str(tmp_path)),
            async_stager=stager,
        )
        _train_step(model, opt)
        resp.upload_completion.result()
        assert set(stager.slab_names()) <= pooled
        assert _my_segments() == set(stager.slab_names())
    loaded = _load_model_sd(str(tmp_path), expected)
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


def test_the_guard_leaves_step_hooks_registered_after_it_working():
    """The one-off post-hook that starts the pre-fault must not be removed while torch
    iterates the post-hooks: a hook registered after the guard (an EMA, a logger, TorchTitan's
    MoE bias update) used to make the first step raise "OrderedDict mutated"."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    calls = []
    with ArenaStager() as stager:
        stager.guard(opt)
        opt.register_step_post_hook(lambda *_: calls.append(1))
        for _ in range(3):
            _train_step(model, opt)
        assert calls == [1, 1, 1]
        assert stager._prefaulted is not None  # the first step still started the pre-fault
        stager._prefaulted.result()
        assert len(opt._optimizer_step_post_hooks) == 1  # the guard's own one is gone


def test_prefault_respects_max_bytes():
    with ArenaStager(max_bytes=1 << 20) as stager:
        with pytest.raises(CapacityError, match="max_bytes"):
            stager.prefault(2 << 20)
        assert not _my_segments()


def test_a_future_nobody_waits_on_still_completes_and_result_elsewhere_works():
    """The copy waits for the caller to let go of the future, but never forever."""
    live = {"w": torch.randn(1000)}
    with ArenaStager() as stager:
        fut = stager.stage(live)
        stager.synchronize_staging()  # nobody touched the future: the copy still ran
        assert fut.done() and torch.equal(fut.result()["w"], live["w"])
        del fut
        got: list[torch.Tensor] = []
        fut2 = stager.stage(live)

        def elsewhere(f: Future = fut2) -> None:
            got.append(f.result()["w"].clone())

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        assert torch.equal(got[0], live["w"])
        del fut2, elsewhere


def test_a_failed_save_holding_its_staged_dict_does_not_block_the_next_one(tmp_path):
    """The failed save's exception (kept in its upload future) references the staged dict;
    with buffers=1 the next stage() must still get the buffer once that save has ended."""
    model = torch.nn.Linear(256, 256)
    taken = tmp_path / "taken"
    dcp.save({"model": model.state_dict()}, storage_writer=LocalWriter(str(taken)))
    with ArenaStager(wait_timeout_s=60) as stager:
        failed = dcp.async_save(
            {"model": model.state_dict()},
            storage_writer=LocalWriter(str(taken)),  # exists: CheckpointExistsError
            async_stager=stager,
        )
        with pytest.raises(BaseException, match="already"):  # DCP's CheckpointException
            failed.upload_completion.result()
        with torch.no_grad():
            model.weight.add_(1.0)
        expected = _clone(model.state_dict())
        ok = dcp.async_save(  # `failed` is still referenced here
            {"model": model.state_dict()},
            storage_writer=LocalWriter(str(tmp_path / "next")),
            async_stager=stager,
        )
        ok.upload_completion.result()
        del failed, ok
    target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    dcp.load(target, storage_reader=LocalReader(str(tmp_path / "next")))
    for k, v in expected.items():
        assert torch.equal(target["model"][k], v), k


def test_release_when_frees_the_buffer_of_a_failed_save_whose_error_holds_it(tmp_path):
    # executor="other": no thread exit is taken as the end of a save; the staged dict stays
    # referenced through the failed save's exception, so only release_when frees its buffer
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    sd = {"w": torch.ones(4096)}
    for explicit in (False, True):
        stager = ArenaStager(executor="other", wait_timeout_s=1.0)
        try:
            resp = dcp.async_save(sd, storage_writer=LocalWriter(blocker / "c"),
                                  async_stager=stager, no_dist=True)
            if explicit:
                stager.release_when(resp.upload_completion)
            error = resp.upload_completion.exception(timeout=60)
            assert error is not None  # kept: it references the staged dict
            if explicit:
                staged = stager.stage(sd).result(timeout=60)
                assert torch.equal(staged["w"], sd["w"])
            else:
                with pytest.raises(StagingError, match="no buffer was released"):
                    stager.stage(sd)
            del error
        finally:
            stager.close(timeout=1)


def test_release_when_before_any_stage_is_refused():
    with ArenaStager() as stager, pytest.raises(StagingError, match="nothing was staged"):
        stager.release_when(Future())
