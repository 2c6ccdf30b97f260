"""A real TorchTitan training loop (llama3 debug model, FSDP over 2 gloo ranks on CPU)
checkpointing through dcp_plus: kill -9 mid-run, resume from the latest committed
checkpoint, and the loss curve continues exactly.

CPU shims are listed in ``tests/dist/_titan_rank.py`` and ``docs/torchtitan.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan",
    reason="TorchTitan is not installed (pip install 'dcp-plus[torchtitan]', torchtitan==0.3.0)")
pytest.importorskip("tokenizers", reason="TorchTitan's tokenizer needs `tokenizers`")

from tests.dist._titan_assets import make_dataset, make_tokenizer  # noqa: E402
from tests.dist._titan_run import log_tail, run_titan  # noqa: E402

STEPS = 12
INTERVAL = 3
KILL_AT = 8  # every rank SIGKILLs itself when step 8 starts: saves of steps 3 and 6 were issued


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _read_jsonl(path)}


def _committed_steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")
                  if (p / ".metadata").exists())


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three jobs: A runs through (stock recipe + --override.imports); B (the dcp_plus
    recipe) is killed at step 8; C restarts B's job unchanged and resumes."""
    root = tmp_path_factory.mktemp("titan")
    tok, data = make_tokenizer(root / "tokenizer"), make_dataset(root / "data")

    def job(name: str, config: str, dump: Path, extra: list[str],
            env: dict[str, str] | None = None) -> list[int]:
        args = ["--module", "tests.dist._titan_recipe", "--config", config,
                "--hf_assets_path", str(tok), "--dataloader.dataset_path", str(data),
                "--dump_folder", str(dump), "--training.steps", str(STEPS),
                "--checkpoint.interval", str(INTERVAL), *extra]
        env = {"DCPP_TITAN_LOSSES": str(root / f"{name}.losses.jsonl"),
               "DCPP_TITAN_SAVES": str(root / f"{name}.saves.jsonl"), **(env or {})}
        return run_titan(args, root, env=env, name=name)

    out: dict[str, Any] = {"root": root}
    out["A"] = job("A", "stock_cpu", root / "A",
                   ["--override.imports", "dcp_plus.integrations.torchtitan.use_dcp_plus",
                    "--checkpoint.async_mode", "async"])
    out["B"] = job("B", "dcp_plus_cpu", root / "B", [], {"DCPP_TITAN_KILL_AT": str(KILL_AT)})
    out["B_committed"] = _committed_steps(root / "B" / "checkpoint")
    out["C"] = job("C", "dcp_plus_cpu", root / "B", [])
    return out


def test_override_import_selects_dcp_plus_and_training_completes(titan: dict[str, Any]) -> None:
    root = titan["root"]
    assert titan["A"] == [0, 0], log_tail(root, "A")
    log = (root / "A.rank0.log").read_text()
    assert "DcpPlusCheckpointManager.Config" in log  # the override's replacement line
    folder = root / "A" / "checkpoint"
    assert _committed_steps(folder) == [3, 6, 9, 12]
    for step in (3, 12):
        record = json.loads((folder / f"step-{step}" / ".metadata").read_text())
        assert record["format"] == "dcp_plus"
    losses = _losses(root / "A.losses.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1]  # it trains


def test_last_save_is_model_only(titan: dict[str, Any]) -> None:
    folder = titan["root"] / "A" / "checkpoint"
    full = json.loads((folder / "step-9" / ".metadata").read_text())
    last = json.loads((folder / "step-12" / ".metadata").read_text())
    text_full, text_last = json.dumps(full), json.dumps(last)
    assert "optimizer" in text_full and "train_state" in text_full
    assert "dataloader" in text_full
    assert "optimizer" not in text_last and "train_state" not in text_last


def test_killed_job_resumes_from_latest_and_loss_curve_continues_exactly(
        titan: dict[str, Any]) -> None:
    root = titan["root"]
    assert all(code != 0 for code in titan["B"]), "job B was meant to be killed at step 8"
    committed = titan["B_committed"]
    assert committed and committed[-1] in (3, 6), committed  # 6 unless its persist was cut
    resumed_from = committed[-1]
    assert titan["C"] == [0, 0], log_tail(root, "C")
    assert f"Loading the checkpoint from {root / 'B' / 'checkpoint' / f'step-{resumed_from}'}" \
        in (root / "C.rank0.log").read_text()

    a, b, c = (_losses(root / f"{n}.losses.jsonl") for n in "ABC")
    assert sorted(b) == list(range(1, KILL_AT))
    assert sorted(c) == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in b.items():  # same seed, same data: the runs agree before the kill
        assert loss == a[step], (step, loss, a[step])
    for step, loss in c.items():  # model, optimizer, LR schedule, data position restored
        assert loss == a[step], (step, loss, a[step])


def test_saves_report_their_blocking_time(titan: dict[str, Any]) -> None:
    saves = _read_jsonl(titan["root"] / "A.saves.jsonl")
    steps = sorted({s["step"] for s in saves})
    assert steps == [3, 6, 9, 12]
    assert {s["rank"] for s in saves} == {0, 1}


def test_full_saves_after_the_first_reuse_the_cached_plan(titan: dict[str, Any]) -> None:
    log = (titan["root"] / "A.rank0.log").read_text()
    assert "step 3 save reused its cached plan: False" in log  # first of its structure
    assert "step 6 save reused its cached plan: True" in log
    assert "step 9 save reused its cached plan: True" in log
