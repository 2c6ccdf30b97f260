"""``CheckpointManager(incremental=True)``: chains bounded by ``full_every``, retention and
``dcp-plus gc`` keeping every checkpoint a kept one references, ``verify`` following them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import CheckpointManager, LocalReader, SafeLoadPlanner
from dcp_plus.cli.gc import collect
from dcp_plus.cli.stray import strays
from dcp_plus.errors import InvalidOptionError
from dcp_plus.manager.retention import to_remove
from dcp_plus.readers.inspect import load_record, verify
from tests.conftest import assert_bit_exact, clone_state, flip_byte, random_tensor

ROWS = 4096  # 4 MiB of float32 rows of 256: 4 parts of 1 MiB


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"emb": random_tensor((ROWS, 256), torch.float32, gen),
            "frozen": random_tensor((1 << 20,), torch.float32, gen), "step": 0}


def _touch(state: dict[str, Any], step: int, spread: bool = False) -> None:
    """40 random rows of ``emb``: spread over the table (every part dirty), or else inside
    its part ``step % 4`` (so that a link references each earlier one)."""
    rows = torch.randperm(ROWS if spread else ROWS // 4,
                          generator=torch.Generator().manual_seed(step))[:40]
    state["emb"][rows + (0 if spread else step % 4 * ROWS // 4)] += 1
    state["step"] = step


def _record(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step_{step:08d}" / ".metadata").read_bytes())


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


def _run(root: Path, steps: range, state: dict[str, Any], spread: bool = False,
         **kw: Any) -> dict[int, Any]:
    seen = {}
    with CheckpointManager(root, interval=1, **kw) as m:
        for step in steps:
            _touch(state, step, spread)
            m.save(step, state).result(timeout=120)
            seen[step] = clone_state(state)
    return seen


def test_chains_restart_every_full_every_saves_and_retention_keeps_their_bases(tmp_path):
    state = _state()
    seen = _run(tmp_path, range(1, 8), state, incremental=True, full_every=3, delta=True,
                keep_last=1)

    # saves 1, 4, 7 are full; 2-3 and 5-6 reference their chain's earlier links
    assert _record(tmp_path, 7)["bases"] == []
    assert _steps(tmp_path) == [7]  # nothing references an older link any more
    with CheckpointManager(tmp_path, interval=1, incremental=True, full_every=3,
                           keep_last=1) as m:
        _touch(state, 8)
        m.save(8, state).result(timeout=120)  # a new manager's first save is full
        assert _record(tmp_path, 8)["bases"] == []
    seen = _run(tmp_path, range(9, 12), state, incremental=True, full_every=4, keep_last=1)
    assert _record(tmp_path, 11)["bases"] == ["step_00000009", "step_00000010"]
    assert _steps(tmp_path) == [9, 10, 11]  # keep_last=1, and the bases of 11
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()}
    with CheckpointManager(tmp_path, read_only=True) as m:
        assert m.load_latest(target) == 11
    assert_bit_exact(target, seen[11])


def test_deltas_against_the_previous_snapshot_are_a_fraction_of_the_changed_parts(tmp_path):
    _run(tmp_path, range(1, 3), _state(), spread=True, incremental=True, delta=True)

    parts = next(e for e in _record(tmp_path, 2)["extents"] if e["fqn"] == "emb")["parts"]
    assert {p["codec"] for p in parts} == {"xor+zstd+shuffle"}  # 40 rows dirty every part
    assert sum(p["length"] for p in parts) < (ROWS * 256 * 4) // 10
    frozen = next(e for e in _record(tmp_path, 2)["extents"] if e["fqn"] == "frozen")
    assert frozen["base"] == "step_00000001"


def test_gc_keeps_the_bases_of_what_it_keeps(tmp_path):
    _run(tmp_path, range(1, 5), _state(), incremental=True, full_every=8, keep_last=None)

    plan = collect(str(tmp_path), keep_last=1, dry_run=True)
    assert [r["step"] for r in plan["remove"]] == []  # 4 references 1, 2 and 3
    assert _record(tmp_path, 4)["bases"] == [f"step_{s:08d}" for s in (1, 2, 3)]
    out = collect(str(tmp_path), keep_last=1)
    assert out["remove"] == [] and _steps(tmp_path) == [1, 2, 3, 4]
    assert verify(str(tmp_path / "step_00000004")).ok


def test_verify_follows_references_and_names_the_damaged_base(tmp_path):
    _run(tmp_path, range(1, 3), _state(), incremental=True)
    frozen = next(e for e in _record(tmp_path, 2)["extents"] if e["fqn"] == "frozen")
    part = frozen["parts"][2]
    flip_byte(tmp_path / "step_00000001" / part["file"], part["offset"] + 100)

    report = verify(str(tmp_path / "step_00000002"))

    assert not report.ok
    assert any("base checkpoint 'step_00000001'" in p and "'frozen'" in p
               for p in report.problems), report.problems


def test_retention_never_drops_a_referenced_step_and_stops_when_one_is_unknown():
    refs = {5: {3, 4}, 6: set(), 4: {3}}
    assert to_remove([1, 2, 3, 4, 5], 1, None, refs.get) == [1, 2]
    assert to_remove([1, 2, 3, 4, 5, 6], 2, None, refs.get) == [1, 2]
    assert to_remove([1, 2, 3], 1, None, lambda s: None) == []


@pytest.mark.parametrize("kwargs", [{"full_every": 0}, {"full_every": 200},
                                    {"incremental": False, "delta": True}])
def test_bad_incremental_settings_are_refused_at_construction(tmp_path, kwargs):
    with pytest.raises(InvalidOptionError):
        CheckpointManager(tmp_path, **{"incremental": True, **kwargs})


def test_saving_a_step_again_keeps_what_other_checkpoints_reference(tmp_path):
    """Steps 1-3 chain; step 2 saved again (its base, step 3, references it): it is a full
    save, and the files of the step 2 it replaced stay for step 3."""
    state = _state()
    seen = _run(tmp_path, range(1, 4), state, incremental=True, keep_last=None)
    step2 = tmp_path / "step_00000002"
    with CheckpointManager(tmp_path, interval=1, incremental=True, keep_last=None) as m:
        for i, step in enumerate((2, 2, 3)):  # the same step twice in a row, then the newest
            replaced = {e["file"] for e in _record(tmp_path, step)["extents"]
                        if (tmp_path / f"step_{step:08d}" / e["file"]).exists()}  # its own
            _touch(state, 10 + step)
            m.save(step, state).result(timeout=120)
            seen[step] = clone_state(state)
            if i == 0:  # step 3 reads the tensor file of the step 2 just replaced
                stray, error = strays(step2, load_record(step2))
                assert error is None, error
                read_by_3 = {f for f in replaced if f.startswith("__0_0.")}
                assert read_by_3 and all((step2 / f).exists() for f in read_by_3)
                assert not read_by_3 & {name for name, _ in stray}, stray

    # what verify calls stray is what no record reads: removing it breaks no checkpoint
    removed = []
    for step in (1, 2, 3):
        folder = tmp_path / f"step_{step:08d}"
        stray, error = strays(folder, load_record(folder))
        assert verify(str(folder)).ok and error is None, (step, error)
        for name, _ in stray:
            (folder / name).unlink()
            removed.append((step, name))
    # the second re-save of step 2 and the re-save of step 3 left files nothing reads now
    assert {s for s, _ in removed} == {2, 3}, removed
    for step in (1, 2, 3):
        assert verify(str(tmp_path / f"step_{step:08d}")).ok, step
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state.items()}
    with CheckpointManager(tmp_path, read_only=True) as m:
        assert m.load_latest(target) == 3
    assert_bit_exact(target, seen[3])
    for step in (1, 2):
        target = {k: torch.zeros_like(v) if torch.is_tensor(v) else None
                  for k, v in state.items()}
        dcp.load(target, storage_reader=LocalReader(tmp_path / f"step_{step:08d}"),
                 planner=SafeLoadPlanner(), no_dist=True)
        assert_bit_exact(target, seen[step])


def test_retention_cut_short_never_leaves_a_checkpoint_whose_base_is_gone(tmp_path):
    """Retention removes newest first: a crash between two removals (here, right after the
    first record goes) leaves the older one, a base, whole (a 30-kill soak found the other
    order leaving a committed link whose base a restart then cleaned up)."""
    from dcp_plus.manager.root import CheckpointRoot
    from dcp_plus.manager.storage import LocalBackend

    _run(tmp_path, range(1, 5), _state(), incremental=True, full_every=2, keep_last=None)
    assert _record(tmp_path, 2)["bases"] == ["step_00000001"]

    class Crash(Exception):
        pass

    def crash(step: int) -> None:
        raise Crash(step)

    with pytest.raises(Crash) as info:
        CheckpointRoot(LocalBackend(), str(tmp_path)).retain(2, None, crash)
    assert info.value.args == (2,)  # step 2 went first (its record only), step 1 is intact
    with CheckpointManager(tmp_path, keep_last=None, takeover=True) as m:  # the restart
        assert [c.step for c in m.list()] == [1, 3, 4]
    assert verify(str(tmp_path / "step_00000001")).ok
