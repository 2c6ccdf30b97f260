"""A checkpoint of many small tensors (the columnar record's case) saves and loads bit-exact
through the plugins, and ``dcp-plus inspect --json`` lists every tensor. CI saves 5,000;
``-m slow`` 100,000 (~25 s here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcp_plus.cli.main import main as cli
from dcp_plus.format.record import COLUMNAR_VERSION
from tests.conftest import assert_bit_exact, load, read_record_json, save


def _state(n: int) -> dict[str, torch.Tensor]:
    values = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
    return {f"layers.{i}.w": values[i].clone() for i in range(n)}


def _round_trip(n: int, path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state(n)
    save(state, path)
    assert read_record_json(path)["version"] == COLUMNAR_VERSION
    target = {k: torch.full_like(v, -3.0) for k, v in state.items()}
    assert_bit_exact(load(target, path), state)
    capsys.readouterr()
    assert cli(["inspect", "--json", str(path)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed["items"]) == n


def test_five_thousand_tensors_round_trip_bit_exact(tmp_path, capsys):
    _round_trip(5_000, tmp_path / "ckpt", capsys)


@pytest.mark.slow
def test_a_hundred_thousand_tensors_round_trip_bit_exact(tmp_path, capsys):
    _round_trip(100_000, tmp_path / "ckpt", capsys)
