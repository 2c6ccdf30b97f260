"""CheckpointManager on an fsspec URL (memory://): commit, latest, retention, resume, and a
corrupted newest checkpoint skipped — the same rules as on a local directory."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from dcp_plus.manager import CheckpointManager
from tests.conftest import assert_bit_exact, clone_state, load_target
from tests.unit.test_manager import state


@pytest.fixture
def root():
    url = f"memory://mgr-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _steps(root: str) -> dict[int, str]:
    fs = fsspec.filesystem("memory")
    out = {}
    for p in fs.ls(root.replace("memory://", "/"), detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step_"):
            out[int(name[5:])] = p
    return out


def test_saves_commit_advance_latest_and_retain_on_an_object_store(root):
    with CheckpointManager(root, keep_last=2, interval=1) as m:
        for step in (1, 2, 3):
            m.save(step, state(step)).result(timeout=60)
        assert [c.step for c in m.list()] == [2, 3]
        assert m.latest_step() == 3
    assert sorted(_steps(root)) == [2, 3]  # step 1's objects are gone, not just hidden


def test_load_latest_resumes_bit_exact_and_skips_a_corrupted_newest(root):
    expected = clone_state(state(2))
    with CheckpointManager(root, interval=1) as m:
        m.save(1, state(1)).result(timeout=60)
        m.save(2, state(2)).result(timeout=60)
    target = load_target(expected)
    with CheckpointManager(root) as m:
        assert m.load_latest(target) == 2
    assert_bit_exact(target, expected)

    fs = fsspec.filesystem("memory")
    newest = _steps(root)[2]
    data_file = next(p for p in fs.ls(newest, detail=False) if p.endswith(".dcpp"))
    raw = bytearray(fs.cat_file(data_file))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(data_file, bytes(raw))
    with CheckpointManager(root) as m:
        assert m.load_latest(load_target(expected)) == 1
