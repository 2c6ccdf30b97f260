"""A real TorchTitan training loop (llama3 debug model, FSDP over 2 gloo ranks on CPU)
checkpointing through dcp_plus: kill -9 mid-run, resume from the latest committed
checkpoint, and the loss curve continues exactly: with TorchTitan's fixed interval, with the
adaptive interval (``checkpoint.adaptive_budget``), and to a real S3 endpoint (SeaweedFS).

CPU shims are listed in ``tools/testkit/titan/rank.py`` and ``docs/torchtitan.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan",
    reason="TorchTitan is not installed (pip install 'dcp-plus[torchtitan]', torchtitan==0.3.0)")
pytest.importorskip("tokenizers", reason="TorchTitan's tokenizer needs `tokenizers`")

from tools.testkit.seaweed import BUCKET  # noqa: E402
from tools.testkit.titan.run import (  # noqa: E402
    committed_steps,
    log_tail,
    losses_of,
    read_jsonl,
    titan_job,
)

STEPS = 12
INTERVAL = 3
KILL_AT = 8  # every rank SIGKILLs itself when step 8 starts: saves of steps 3 and 6 were issued


def _saved_steps(root: Path, name: str, rank: int) -> list[int]:
    """Steps at which ``save()`` returned True on ``rank``."""
    return [r["step"] for r in read_jsonl(root / f"{name}.saves.jsonl") if r["rank"] == rank]


def _resumed_from(root: Path, name: str, folder: str) -> int | None:
    m = re.search(re.escape(f"Loading the checkpoint from {folder}/step-") + r"(\d+)",
                  (root / f"{name}.rank0.log").read_text())
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def titan(titan_reference: dict[str, Any]) -> dict[str, Any]:
    """Job A (``titan_reference``: runs through, stock recipe + --override.imports); B (the
    dcp_plus recipe) is killed at step 8; C restarts B's job unchanged and resumes."""
    root = titan_reference["root"]
    out: dict[str, Any] = dict(titan_reference)
    out["B"] = titan_job(root, "B", "dcp_plus_cpu", root / "B", [],
                         {"DCPP_TITAN_KILL_AT": str(KILL_AT)})
    out["B_committed"] = committed_steps(root / "B" / "checkpoint")
    out["C"] = titan_job(root, "C", "dcp_plus_cpu", root / "B", [])
    return out


def test_override_import_selects_dcp_plus_and_training_completes(titan: dict[str, Any]) -> None:
    root = titan["root"]
    assert titan["A"] == [0, 0], log_tail(root, "A")
    log = (root / "A.rank0.log").read_text()
    assert "DcpPlusCheckpointManager.Config" in log  # the override's replacement line
    folder = root / "A" / "checkpoint"
    assert committed_steps(folder) == [3, 6, 9, 12]
    for step in (3, 12):
        record = json.loads((folder / f"step-{step}" / ".metadata").read_text())
        assert record["format"] == "dcp_plus"
    losses = losses_of(root / "A.losses.jsonl")
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

    a, b, c = (losses_of(root / f"{n}.losses.jsonl") for n in "ABC")
    assert sorted(b) == list(range(1, KILL_AT))
    assert sorted(c) == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in b.items():  # same seed, same data: the runs agree before the kill
        assert loss == a[step], (step, loss, a[step])
    for step, loss in c.items():  # model, optimizer, LR schedule, data position restored
        assert loss == a[step], (step, loss, a[step])


def test_saves_report_their_blocking_time(titan: dict[str, Any]) -> None:
    saves = read_jsonl(titan["root"] / "A.saves.jsonl")
    steps = sorted({s["step"] for s in saves})
    assert steps == [3, 6, 9, 12]
    assert {s["rank"] for s in saves} == {0, 1}


def test_full_saves_after_the_first_reuse_the_cached_plan(titan: dict[str, Any]) -> None:
    log = (titan["root"] / "A.rank0.log").read_text()
    assert "step 3 save reused its cached plan: False" in log  # first of its structure
    assert "step 6 save reused its cached plan: True" in log
    assert "step 9 save reused its cached plan: True" in log


# -- adaptive interval ----------------------------------------------------------------------

ADAPTIVE_P = 0.05
ADAPTIVE_WARMUP = 2
ADAPTIVE_KILL_AT = 10
_K_FROM = re.compile(r"adaptive interval: k=(\d+) from step (\d+)")
_CKPT_AT = re.compile(r"adaptive interval: checkpoint at step (\d+) \((profiling|k=\d+)\)")


def _policy_log(root: Path, name: str) -> tuple[dict[int, int], list[int]]:
    """Rank 0's logged decisions: {step: k in force from it}, checkpointed steps."""
    text = (root / f"{name}.rank0.log").read_text()
    k_from = {int(m.group(2)): int(m.group(1)) for m in _K_FROM.finditer(text)}
    return k_from, [int(m.group(1)) for m in _CKPT_AT.finditer(text)]


@pytest.fixture(scope="module")
def adaptive(titan: dict[str, Any]) -> dict[str, Any]:
    """D: the dcp_plus recipe with ``--checkpoint.adaptive_budget``, killed at step 10;
    E restarts it unchanged and resumes."""
    root = titan["root"]
    flags = ["--checkpoint.adaptive_budget", str(ADAPTIVE_P),
             "--checkpoint.adaptive_warmup", str(ADAPTIVE_WARMUP)]
    out: dict[str, Any] = {"root": root}
    # every persist ends before the next step: the two profiling saves (steps 3 and 4) are
    # then reported by step 5 however loaded the machine is, which a kill at step 10 needs
    out["D"] = titan_job(root, "D", "dcp_plus_cpu", root / "D", flags,
                         {"DCPP_TITAN_KILL_AT": str(ADAPTIVE_KILL_AT),
                          "DCPP_TITAN_SERIAL_SAVES": "1"})
    out["D_committed"] = committed_steps(root / "D" / "checkpoint")
    out["E"] = titan_job(root, "E", "dcp_plus_cpu", root / "D", flags)
    return out


def test_adaptive_checkpoint_steps_follow_the_policy_on_every_rank(
        adaptive: dict[str, Any]) -> None:
    root = adaptive["root"]
    assert all(code != 0 for code in adaptive["D"]), "job D was meant to be killed at step 10"
    assert "checkpoint steps chosen by AdaptiveInterval(p=0.05, warmup=2)" in \
        (root / "D.rank0.log").read_text()
    k_from, chosen = _policy_log(root, "D")
    # the same steps on both ranks (rank 0 decides and broadcasts), and they are the policy's
    assert _saved_steps(root, "D", 0) == _saved_steps(root, "D", 1) == chosen
    # profiling starts after the warm-up iterations; no step-multiple-of-interval saves
    assert chosen[0] == ADAPTIVE_WARMUP + 1
    assert k_from and min(k_from) <= ADAPTIVE_WARMUP + 3, k_from  # profiled at steps 3, 4
    tuned_from = min(k_from)
    # replay: from the step k was set, a step is checkpointed iff it is k past the last one
    last = max(s for s in chosen if s < tuned_from)
    k = None
    for step in range(tuned_from, ADAPTIVE_KILL_AT):
        k = k_from.get(step, k)
        assert k is not None
        assert (step in chosen) == (step - last >= k), (step, last, k, chosen)
        if step in chosen:
            last = step
    # (whether a tuned checkpoint falls before the kill depends on the k this machine's speed
    # gives; the replay above checks every step's decision either way)
    committed = adaptive["D_committed"]
    assert committed and set(committed) <= set(chosen)
    assert committed[-1] == chosen[-1]  # serial saves: every persist ends before the kill


def test_adaptive_resume_continues_the_loss_curve_exactly(
        titan: dict[str, Any], adaptive: dict[str, Any]) -> None:
    root = adaptive["root"]
    assert adaptive["E"] == [0, 0], log_tail(root, "E")
    resumed_from = _resumed_from(root, "E", str(root / "D" / "checkpoint"))
    assert resumed_from == adaptive["D_committed"][-1]
    a, d, e = (losses_of(root / f"{n}.losses.jsonl") for n in "ADE")
    assert sorted(d) == list(range(1, ADAPTIVE_KILL_AT))
    assert sorted(e) == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in {**d, **e}.items():  # saving on other steps changes nothing
        assert loss == a[step], (step, loss, a[step])
    # the resumed job profiles afresh; its forced last save is its own, on both ranks
    _, chosen = _policy_log(root, "E")
    assert _saved_steps(root, "E", 0) == _saved_steps(root, "E", 1) == [*chosen, STEPS]
    if chosen:
        assert chosen[0] == resumed_from + ADAPTIVE_WARMUP + 1


# -- incremental checkpoints -------------------------------------------------------------------

INCR_KILL_AT = 11  # saves of steps 3, 6 and 9 were issued: a chain of 3 under keep_latest_k=2


@pytest.fixture(scope="module")
def incremental(titan: dict[str, Any]) -> dict[str, Any]:
    """I: incremental checkpoints with deltas and ``keep_latest_k=2``, killed at step 11; J
    restarts it unchanged and resumes."""
    root = titan["root"]
    out: dict[str, Any] = {"root": root}
    out["I"] = titan_job(root, "I", "dcp_plus_incremental_cpu", root / "I", [],
                         {"DCPP_TITAN_KILL_AT": str(INCR_KILL_AT)})
    folder = root / "I" / "checkpoint"
    out["I_committed"] = committed_steps(folder)
    out["I_bases"] = {s: json.loads((folder / f"step-{s}" / ".metadata").read_text())["bases"]
                      for s in out["I_committed"]}
    out["J"] = titan_job(root, "J", "dcp_plus_incremental_cpu", root / "I", [])
    return out


def test_incremental_checkpoints_resume_exactly_and_the_purge_keeps_their_bases(
        titan: dict[str, Any], incremental: dict[str, Any]) -> None:
    root = incremental["root"]
    assert all(code != 0 for code in incremental["I"]), "job I was meant to be killed"
    committed, bases = incremental["I_committed"], incremental["I_bases"]
    # 9 unless its persist was cut by the kill; 3 is kept beyond keep_latest_k=2 because
    # 6 (and 9) reference it
    assert committed in ([3, 6], [3, 6, 9]), committed
    assert bases[3] == [] and bases[6] == ["step-3"]
    if 9 in committed:
        assert bases[9] == ["step-3", "step-6"]
    assert incremental["J"] == [0, 0], log_tail(root, "J")
    resumed_from = committed[-1]
    assert _resumed_from(root, "J", str(root / "I" / "checkpoint")) == resumed_from
    a, i, j = (losses_of(root / f"{n}.losses.jsonl") for n in "AIJ")
    assert sorted(j) == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in {**i, **j}.items():  # deltas decoded through the chain, exactly
        assert loss == a[step], (step, loss, a[step])


# -- S3 (SeaweedFS) ---------------------------------------------------------------------------

S3_PREFIX = "titan-run"


@pytest.fixture(scope="module")
def s3_jobs(titan: dict[str, Any], seaweed: Any) -> dict[str, Any]:
    """F: the dcp_plus recipe checkpointing to s3://ckpt/titan-run/checkpoint, killed at
    step 8; G restarts it unchanged and resumes from S3. The endpoint and credentials reach
    both dcp_plus's writer/reader and TorchTitan's own folder listing through fsspec's config
    (``FSSPEC_S3``)."""
    s3fs = pytest.importorskip("s3fs")
    root = titan["root"]
    folder = f"s3://{BUCKET}/{S3_PREFIX}/checkpoint"
    env = {"FSSPEC_S3": json.dumps(seaweed.storage_options())}
    flags = ["--checkpoint.folder", folder]
    out: dict[str, Any] = {"root": root, "folder": folder}
    out["F"] = titan_job(root, "F", "dcp_plus_cpu", root / "F", flags,
                         {**env, "DCPP_TITAN_KILL_AT": str(KILL_AT)})
    # no listing cache: G's saves must be seen after F's listing
    fs = s3fs.S3FileSystem(**seaweed.storage_options(skip_instance_cache=True,
                                                     use_listings_cache=False))
    out["F_committed"] = sorted(
        int(p.rstrip("/").rsplit("-", 1)[1]) for p in fs.ls(folder.removeprefix("s3://"))
        if fs.exists(f"{p}/.metadata"))
    out["G"] = titan_job(root, "G", "dcp_plus_cpu", root / "F", flags, env)
    out["fs"] = fs
    return out


def test_s3_checkpoints_through_torchtitan_resume_bit_exact(
        titan: dict[str, Any], s3_jobs: dict[str, Any]) -> None:
    root, folder, fs = s3_jobs["root"], s3_jobs["folder"], s3_jobs["fs"]
    assert all(code != 0 for code in s3_jobs["F"]), "job F was meant to be killed at step 8"
    committed = s3_jobs["F_committed"]
    assert committed and committed[-1] in (3, 6), committed
    assert not (root / "F" / "checkpoint").exists()  # nothing went to the local dump folder
    record = json.loads(fs.cat(f"{folder.removeprefix('s3://')}/step-{committed[-1]}/.metadata"))
    assert record["format"] == "dcp_plus"
    assert s3_jobs["G"] == [0, 0], log_tail(root, "G")
    resumed_from = _resumed_from(root, "G", folder)
    assert resumed_from == committed[-1]
    a, f, g = (losses_of(root / f"{n}.losses.jsonl") for n in "AFG")
    assert sorted(f) == list(range(1, KILL_AT))
    assert sorted(g) == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in {**f, **g}.items():
        assert loss == a[step], (step, loss, a[step])
    # G's saves (9, and the model-only last step) are in the bucket, committed
    assert fs.exists(f"{folder.removeprefix('s3://')}/step-9/.metadata")
    assert fs.exists(f"{folder.removeprefix('s3://')}/step-{STEPS}/.metadata")


@pytest.fixture(scope="module")
def adopted(titan: dict[str, Any]) -> dict[str, Any]:
    """A stock TorchTitan job (S, no dcp_plus) killed at step 8 leaves stock checkpoints; the
    same job rerun with dcp_plus (T) refuses them, naming the setting; rerun with that setting
    (U) it resumes."""
    root = titan["root"]
    dump = root / "S"
    override = "dcp_plus.integrations.torchtitan.use_dcp_plus"
    out: dict[str, Any] = {"root": root, "dump": dump}
    out["S"] = titan_job(root, "S", "stock_cpu", dump, [], {"DCPP_TITAN_KILL_AT": str(KILL_AT)})
    out["S_committed"] = committed_steps(dump / "checkpoint")
    out["T"] = titan_job(root, "T", "stock_cpu", dump, ["--override.imports", override])
    out["U"] = titan_job(root, "U", "stock_cpu", dump,
                         ["--override.imports", f'{override}={{"allow_pickle_on_load": true}}'])
    return out


def test_adopting_dcp_plus_on_stock_checkpoints_names_the_setting_and_then_resumes(
        titan: dict[str, Any], adopted: dict[str, Any]) -> None:
    root, dump = adopted["root"], adopted["dump"]
    committed = adopted["S_committed"]
    assert committed and committed[-1] in (3, 6), committed
    assert all(code != 0 for code in adopted["T"])
    # the error the job ends with (DCP also logs the reader's own one on its way)
    final = [line for line in (root / "T.rank0.log").read_text().splitlines()
             if "StockCheckpointError:" in line][-1]
    assert "written by stock DCP" in final and "checkpoint.allow_pickle_on_load" in final
    assert "use_dcp_plus={\"allow_pickle_on_load\": true}" in final
    assert "LocalReader" not in final  # not the reader API a TorchTitan user never calls
    assert adopted["U"] == [0, 0], log_tail(root, "U")
    resumed_from = committed[-1]
    assert f"Loading the checkpoint from {dump / 'checkpoint' / f'step-{resumed_from}'}" \
        in (root / "U.rank0.log").read_text()
    a, u = losses_of(root / "A.losses.jsonl"), losses_of(root / "U.losses.jsonl")
    assert sorted(u) == list(range(resumed_from + 1, STEPS + 1))
    for step, loss in u.items():
        assert loss == a[step], (step, loss, a[step])
    record = (dump / "checkpoint" / "step-9" / ".metadata").read_bytes()
    assert record[:1] == b"{"  # saved by dcp_plus from then on


def test_converted_to_stock_dcp_a_step_resumes_in_stock_torchtitan(
        titan: dict[str, Any], adopted: dict[str, Any]) -> None:
    import subprocess
    import sys

    root = titan["root"]
    src = adopted["dump"] / "checkpoint" / "step-9"  # saved by dcp_plus (job U)
    assert (src / ".metadata").read_bytes()[:1] == b"{"
    dump = root / "V"
    dst = dump / "checkpoint" / "step-9"
    dst.parent.mkdir(parents=True)
    conv = subprocess.run([sys.executable, "-m", "dcp_plus", "convert", str(src), str(dst),
                           "--to", "dcp"], capture_output=True, text=True, timeout=300)
    assert conv.returncode == 0, conv.stderr
    assert (dst / ".metadata").read_bytes()[:1] != b"{"  # a stock (pickled) record
    assert titan_job(root, "V", "stock_cpu", dump, []) == [0, 0], log_tail(root, "V")
    assert f"Loading the checkpoint from {dst}" in (root / "V.rank0.log").read_text()
    a, v = losses_of(root / "A.losses.jsonl"), losses_of(root / "V.losses.jsonl")
    assert sorted(v) == list(range(10, STEPS + 1))
    for step, loss in v.items():
        assert loss == a[step], (step, loss, a[step])


def test_settings_in_the_override_json_reach_dcp_plus_on_a_stock_config(
        titan: dict[str, Any]) -> None:
    """The documented form for a stock config: dcp_plus's settings in the override's JSON
    (TorchTitan refuses them as --checkpoint.* flags there)."""
    root = titan["root"]
    override = ('dcp_plus.integrations.torchtitan.use_dcp_plus='
                '{"adaptive_budget": 0.05, "adaptive_warmup": 2}')
    assert titan_job(root, "W", "stock_cpu", root / "W", ["--override.imports", override,
                                                           "--checkpoint.async_mode", "async"]) \
        == [0, 0], log_tail(root, "W")
    assert "checkpoint steps chosen by AdaptiveInterval(p=0.05, warmup=2)" in \
        (root / "W.rank0.log").read_text()
    refused = titan_job(root, "X", "stock_cpu", root / "X",
                        ["--override.imports", "dcp_plus.integrations.torchtitan.use_dcp_plus",
                         "--checkpoint.adaptive_budget", "0.05"])
    assert all(code != 0 for code in refused)
    assert "Unrecognized options: --checkpoint.adaptive_budget" in (root / "X.rank0.log").read_text()
