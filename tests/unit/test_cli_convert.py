"""`dcp-plus convert`, run as the real command in a subprocess: every conversion round trips
bit-exact (checked with the other side's own reader), bad input is refused with exit 2,
a damaged source exits 1, and a failed conversion leaves nothing at the destination."""

from __future__ import annotations

import datetime
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_plus import LocalReader, LocalWriter, SafeLoadPlanner
from tests.conftest import assert_bit_exact, flip_byte, random_tensor, read_record_json
from tests.unit.test_cli_ls_diff import run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state() -> dict[str, Any]:
    """A model and training state: several dtypes (bf16 too), a transposed (non-contiguous)
    and a 0-dim tensor, an empty one, plain values and an io.BytesIO."""
    g = torch.Generator().manual_seed(5)
    base = random_tensor((6, 8), torch.float32, g)
    return {
        "model": {"embed.weight": random_tensor((16, 8), torch.bfloat16, g),
                  "layers.0.weight": base.t(), "layers.0.bias": random_tensor((6,), torch.float16, g),
                  "layers.0.scale": torch.tensor(0.5, dtype=torch.float64),
                  "mask": random_tensor((5,), torch.bool, g),
                  "positions": torch.arange(-3, 9, dtype=torch.int64)},
        "optim": {"state": {"exp_avg": random_tensor((6, 8), torch.float32, g)}, "lr": 0.125,
                  "name": "adamw"},
        "step": 17,
        "rng": io.BytesIO(b"\x00raw rng state\xff"),
    }


def plain(value: Any) -> Any:
    """``value`` with io.BytesIO values as their bytes (BytesIO compares by identity)."""
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    actual, expected = plain(actual), plain(expected)
    assert sorted(actual) == sorted(expected)
    assert_bit_exact({k: actual[k] for k in expected}, expected)


def load_ours(path: Path) -> dict[str, Any]:
    target = {k: v for k, v in state().items()}
    target["model"] = {k: torch.zeros_like(v) for k, v in target["model"].items()}
    target["optim"] = {"state": {"exp_avg": torch.zeros(6, 8)}, "lr": 0.0, "name": ""}
    target["step"], target["rng"] = 0, io.BytesIO()
    dcp.load(target, storage_reader=LocalReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return target


def load_with_stock_torch_only(path: Path, out: Path) -> dict[str, Any]:
    """Load ``path`` with DCP's own FileSystemReader in a process that never imports
    dcp_plus, and hand the state back through a torch.save file."""
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
        sd = {{}}
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader({str(path)!r}),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert not [m for m in sys.modules if m.startswith("dcp_plus")]
        torch.save(sd, {str(out)!r})
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return torch.load(out, weights_only=False)


@pytest.fixture
def ours(tmp_path: Path) -> Path:
    path = tmp_path / "ours"
    dcp.save(state(), storage_writer=LocalWriter(path), no_dist=True)
    return path


@pytest.fixture
def stock(tmp_path: Path) -> Path:
    path = tmp_path / "stock"
    dcp.save(state(), storage_writer=FileSystemWriter(path), no_dist=True)
    return path


def leftovers(parent: Path, *keep: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p not in keep)


def test_stock_to_dcp_plus_is_bit_exact(stock, tmp_path):
    dst = tmp_path / "converted"
    proc = run("convert", str(stock), str(dst), "--allow-pickle")
    assert proc.returncode == 0, proc.stderr
    assert f"{stock}: stock DCP checkpoint" in proc.stdout
    assert f"wrote {dst} (dcp_plus): 7 tensors" in proc.stdout
    assert (dst / ".metadata").read_bytes()[:1] == b"{"  # our JSON record
    assert_same(load_ours(dst), state())
    assert run("verify", str(dst)).returncode == 0


def test_dcp_plus_to_stock_loads_with_torch_alone(ours, tmp_path):
    dst = tmp_path / "stock"
    proc = run("convert", str(ours), str(dst))  # the default target: the other layout
    assert proc.returncode == 0, proc.stderr
    assert f"{ours}: dcp_plus checkpoint" in proc.stdout and "(dcp)" in proc.stdout
    assert_same(load_with_stock_torch_only(dst, tmp_path / "sd.pt"), state())
    back = tmp_path / "back"  # and back again, through the stock reader this time
    assert run("convert", str(dst), str(back), "--allow-pickle").returncode == 0
    assert_same(load_ours(back), state())


def test_torch_save_export_matches_the_checkpoint(ours, tmp_path):
    whole = tmp_path / "whole.pt"
    proc = run("convert", str(ours), str(whole), "--to", "torch")
    assert proc.returncode == 0, proc.stderr
    assert_same(torch.load(whole, weights_only=False), state())  # as dcp_to_torch_save
    model = tmp_path / "model.pt"
    proc = run("convert", str(ours), str(model), "--to", "torch", "--prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    assert_same(torch.load(model, weights_only=True), state()["model"])
    assert "6 tensors" in proc.stdout and "0 other values" in proc.stdout


def test_safetensors_export_holds_the_tensors_and_names_what_it_left_out(ours, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    dst = tmp_path / "hf"
    proc = run("convert", str(ours), str(dst), "--to", "safetensors", "--prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert_same(safetensors.load_file(dst / "model-00001-of-00001.safetensors"), state()["model"])

    everything = tmp_path / "all"
    proc = run("convert", str(ours), str(everything), "--to", "safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "left out 4 non-tensor values" in proc.stderr
    for name in ("optim.lr", "optim.name", "step", "rng"):
        assert name in proc.stderr
    loaded = safetensors.load_file(everything / "model-00001-of-00001.safetensors")
    assert_bit_exact(loaded["optim.state.exp_avg"], state()["optim"]["state"]["exp_avg"])
    assert len(loaded) == 7


def test_safetensors_max_file_size_splits_into_files(ours, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    dst = tmp_path / "hf"
    proc = run("convert", str(ours), str(dst), "--to", "safetensors", "--prefix", "model.",
               "--max-file-size", "200B")
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    loaded: dict[str, Any] = {}
    for f in files:
        loaded.update(safetensors.load_file(dst / f))
    assert_same(loaded, state()["model"])


def test_safetensors_without_the_package_says_what_to_install(ours, tmp_path):
    blocker = tmp_path / "block" / "safetensors"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(blocker.parent), str(Path(__file__).resolve().parents[2])])}
    proc = subprocess.run([sys.executable, "-m", "dcp_plus", "convert", str(ours),
                           str(tmp_path / "hf"), "--to", "safetensors"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "pip install safetensors" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "hf").exists()


def test_stock_source_is_refused_without_allow_pickle(stock, tmp_path):
    dst = tmp_path / "dst"
    proc = run("convert", str(stock), str(dst))
    assert proc.returncode == 2
    assert "pickle" in proc.stderr and "arbitrary code" in proc.stderr
    assert "--allow-pickle" in proc.stderr
    assert leftovers(tmp_path, stock) == []


def test_an_existing_destination_is_refused_and_kept(ours, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run("convert", str(ours), str(dst))
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    file_dst = tmp_path / "model.pt"
    file_dst.write_bytes(b"old")
    proc = run("convert", str(ours), str(file_dst), "--to", "torch")
    assert proc.returncode == 2 and file_dst.read_bytes() == b"old"

    empty = tmp_path / "empty"  # an empty directory is filled
    empty.mkdir()
    torch_into_dir = run("convert", str(ours), str(empty), "--to", "torch")
    assert torch_into_dir.returncode == 2 and "writes one file" in torch_into_dir.stderr
    assert run("convert", str(ours), str(empty)).returncode == 0
    assert (empty / ".metadata").is_file()


@pytest.mark.parametrize("make", ["empty_dir", "file"])
def test_a_source_that_is_no_checkpoint_is_refused(tmp_path, make):
    src = tmp_path / "src"
    if make == "empty_dir":
        src.mkdir()
    else:
        src.write_text("hello")
    proc = run("convert", str(src), str(tmp_path / "dst"))
    assert proc.returncode == 2 and str(src) in proc.stderr
    assert "no commit record" in proc.stderr or "not a directory" in proc.stderr
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("to", ["dcp_plus", "torch"])
def test_a_corrupted_source_exits_1_and_leaves_no_destination(ours, tmp_path, to):
    ext = next(e for e in read_record_json(ours)["extents"] if e["fqn"] == "model.embed.weight")
    flip_byte(ours / ext["file"], ext["offset"] + 7)
    dst = tmp_path / "dst"
    proc = run("convert", str(ours), str(dst), "--to", to)
    assert proc.returncode == 1, proc.stderr
    assert "CORRUPT" in proc.stderr and "model.embed.weight" in proc.stderr
    assert leftovers(tmp_path, ours) == []  # no destination, no hidden temporary


def test_selection_options_are_checked(ours, tmp_path):
    proc = run("convert", str(ours), str(tmp_path / "a"), "--prefix", "model.")
    assert proc.returncode == 2 and "--prefix selects what an export keeps" in proc.stderr
    proc = run("convert", str(ours), str(tmp_path / "b.pt"), "--to", "torch", "--prefix", "nope.")
    assert proc.returncode == 2 and "keeps none of its" in proc.stderr
    proc = run("convert", str(ours), str(tmp_path / "c"), "--max-file-size", "1GB")
    assert proc.returncode == 2 and "--max-file-size applies to --to safetensors" in proc.stderr
    assert leftovers(tmp_path, ours) == []


def test_a_value_ours_cannot_hold_is_named_and_can_be_excluded(tmp_path):
    src = tmp_path / "stock"
    sd = {"w": torch.arange(4.0), "when": datetime.timedelta(days=1)}
    dcp.save(sd, storage_writer=FileSystemWriter(src), no_dist=True)
    proc = run("convert", str(src), str(tmp_path / "a"), "--allow-pickle")
    assert proc.returncode == 2 and "'when'" in proc.stderr and "--exclude" in proc.stderr
    assert leftovers(tmp_path, src) == []
    proc = run("convert", str(src), str(tmp_path / "b"), "--allow-pickle", "--exclude", "when")
    assert proc.returncode == 0, proc.stderr
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=LocalReader(tmp_path / "b"), no_dist=True)
    assert_bit_exact(out, {"w": torch.arange(4.0)})


def test_an_export_reads_only_what_it_selects(ours, tmp_path):
    ext = next(e for e in read_record_json(ours)["extents"] if e["fqn"] == "optim.state.exp_avg")
    flip_byte(ours / ext["file"], ext["offset"])  # damage outside the selection: never read
    dst = tmp_path / "model.pt"
    proc = run("convert", str(ours), str(dst), "--to", "torch", "--prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    assert_same(torch.load(dst, weights_only=True), state()["model"])
    proc = run("convert", str(ours), str(tmp_path / "all.pt"), "--to", "torch",
               "--exclude", "rng")
    assert proc.returncode == 1 and "optim.state.exp_avg" in proc.stderr
