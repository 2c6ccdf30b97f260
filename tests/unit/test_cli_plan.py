"""`dcp-plus plan`, run as the installed command would run it."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from dcp_plus.cli.main import main
from tests.conftest import ROOT, child_env, run_cli

LLAMA = ["plan", "--params", "405B", "--bytes-per-param", "10", "--ranks", "16384",
         "--sharding", "128", "--storage-gbps", "5", "--iteration-s", "5", "--mtbf-h", "3"]


def test_plan_prints_the_llama3_figures(capsys):
    assert main(LLAMA) == 0
    out = capsys.readouterr().out

    assert "state: 4.05 TB (405B params x 10 B); 31.6 GB per rank" in out
    assert "persist (at 5 GB/s aggregate): 13.5 min" in out
    assert "peer replica: 1.01 TB" in out
    for mode in ("sync", "async", "tiered"):
        assert f"\n{mode} " in out


def test_plan_json_has_every_figure_in_the_unit_its_key_names(capsys):
    assert main([*LLAMA, "--budget", "5%", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)

    assert data["inputs"]["params"] == 405e9 and data["inputs"]["mtbf_s"] == 3 * 3600
    assert data["inputs"]["shard_degree"] == 128 and data["inputs"]["overhead_budget"] == 0.05
    assert data["persist_s"] == pytest.approx(810.0)
    assert data["host_memory_per_node_bytes"] == pytest.approx(1012.5e9)
    assert data["checkfreq_interval_steps"] == 162
    assert data["modes"]["tiered"]["goodput"] > data["modes"]["sync"]["goodput"]


def test_plan_accepts_units_on_durations_and_named_shardings(capsys):
    assert main([*LLAMA[:-4], "--iteration-s", "5000ms", "--mtbf-h", "180min",
                 "--sharding", "hsdp:128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["iteration_s"] == pytest.approx(5.0)
    assert data["inputs"]["mtbf_s"] == pytest.approx(10800.0)
    assert data["per_rank_state_bytes"] == pytest.approx(4.05e12 / 128)

    assert main([*LLAMA, "--sharding", "ddp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 16384


def test_plan_refuses_a_malformed_count_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([*LLAMA, "--params", "405X"])
    assert info.value.code == 2
    assert "not a count: '405X'" in capsys.readouterr().err


def test_plan_refuses_inconsistent_inputs_naming_the_field(capsys):
    assert main([*LLAMA, "--sharding", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dcp-plus plan: ") and "shard_degree must divide ranks=16384" in err


def test_plan_runs_without_importing_torch():
    code = ("import sys; from dcp_plus.cli.main import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *LLAMA], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "13.5 min" in proc.stdout


def test_the_example_in_docs_cli_md_is_what_the_command_prints(capsys):
    text = (ROOT / "docs" / "cli.md").read_text()
    first, second, *printed = text.split("$ dcp-plus plan ", 1)[1].split("```", 1)[0].split("\n")

    assert main(["plan", *first.rstrip("\\").split(), *second.split()]) == 0
    assert capsys.readouterr().out == "\n".join(printed)


# --- the real command in a subprocess ---------------------------------------------------------

SMALL = ["plan", "--params", "7B", "--bytes-per-param", "14", "--ranks", "8",
         "--storage-gbps", "5", "--iteration-s", "1", "--mtbf-h", "0.01"]
PERCENT = re.compile(r"(-?\d+\.\d+)%")


run = run_cli  # in this process: no interpreter start-up per call


def run_json(*argv: str) -> dict:
    proc = run(*argv, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def exact_goodput(t: float, c: float, el: float, r: float, m: float) -> float:
    """docs/cli.md: (T/M) e^(-(T+L+R)/M) / (1 - e^(-(T+C)/M))."""
    return (t / m) * math.exp(-(t + el + r) / m) / (1 - math.exp(-(t + c) / m))


def test_plan_warns_when_the_first_order_model_does_not_hold():
    proc = run(*SMALL)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout

    warning = next(line for line in out.splitlines() if line.startswith("WARNING: "))
    assert "first-order Young/Daly" in warning and "MTBF (36.0 s)" in warning
    assert "goodput model: exponential failures, exact: goodput = (T/M) e^(-(T+L+R)/M)" in out
    assert "Young/Daly interval (sync, first order, MTBF 36.0 s): 38.0 s = 38 steps" in out
    assert all(0 <= float(p) <= 100 for p in PERCENT.findall(out))  # was "lost 1530.33 %"


def test_plan_json_lists_the_warnings_and_keeps_every_share_within_0_and_1():
    data = run_json(*SMALL)

    assert len(data["warnings"]) == 1 and "first-order" in data["warnings"][0]
    m = data["inputs"]["mtbf_s"]
    for mode in data["modes"].values():
        assert 0 <= mode["lost_fraction"] <= 1 and 0 < mode["goodput"] < 1
        t = mode["interval_steps"] * data["inputs"]["iteration_s"]
        assert mode["goodput"] == pytest.approx(exact_goodput(
            t, mode["blocking_s"], mode["durable_after_s"], mode["recovery_s"], m))


def test_plan_says_when_a_job_would_make_no_progress_and_never_goes_past_100_percent():
    proc = run(*SMALL[:-1], "1s")
    assert proc.returncode == 0, proc.stderr
    shares = [float(p) for p in PERCENT.findall(proc.stdout)]
    assert shares and all(0 <= s <= 100 for s in shares)
    assert "WARNING: sync: goodput 0.00%: the job would make almost no progress" in proc.stdout


def test_plan_has_no_warning_when_failures_are_rare():
    data = run_json(*SMALL[:-1], "10000")
    assert data["warnings"] == []
    assert "WARNING" not in run(*SMALL[:-1], "10000").stdout


def test_plan_interval_gives_goodput_at_a_chosen_interval_next_to_the_best():
    longer = {}
    for interval, steps in (("20min", 240), ("40min", 480)):
        data = run_json(*LLAMA, "--interval", interval)
        at, best = data["at_interval"], data["modes"]
        for name, mode in at.items():
            assert mode["interval_steps"] == steps  # ceil(interval / Ti)
            assert mode["goodput"] == pytest.approx(exact_goodput(
                steps * 5.0, mode["blocking_s"], mode["durable_after_s"], mode["recovery_s"],
                3 * 3600.0))
            assert mode["goodput"] <= best[name]["goodput"]  # the best is the best
        longer[interval] = at
    # both beyond async's and tiered's best interval: the longer one loses more
    for name in ("async", "tiered"):
        assert longer["40min"][name]["goodput"] < longer["20min"][name]["goodput"]
        assert longer["40min"][name]["lost_fraction"] > longer["20min"][name]["lost_fraction"]

    out = run(*LLAMA, "--interval", "20min").stdout
    assert "at --interval 20.0 min (every 240 steps, 20.0 min):" in out and "vs best" in out


def test_plan_tw_is_checkfreq_overlap_of_the_snapshot_with_forward_and_backward():
    # 31.64 GB per rank at 25 GB/s: Tc = 1.265625 s; 1 s steps; fast storage
    base = [*LLAMA[:-4], "--iteration-s", "1", "--mtbf-h", "3", "--storage-gbps", "1e4"]
    tc, ti, p = 4.05e12 / 128 / 25e9, 1.0, 0.05
    ts = 4.05e12 / 1e13
    ks = []
    for tw in (0.5, 0.9):
        data = run_json(*base, "--tw", str(tw))
        to = max(0.0, tc - (ti - tw))  # CheckFreq: overlap with the next iteration's F+B
        k = max(math.ceil((tc + ts - to) / ti - 1e-9), math.ceil(to / (p * ti) - 1e-9))
        assert data["exposed_stage_s"] == pytest.approx(to)
        assert data["checkfreq_interval_steps"] == k
        assert data["checkfreq_overhead_fraction"] == pytest.approx(to / (k * ti))
        ks.append(k)
    no_tw = run_json(*base)
    assert no_tw["exposed_stage_s"] == pytest.approx(tc)  # without --tw the copy blocks
    assert ks[0] < ks[1] < no_tw["checkfreq_interval_steps"]  # 16 < 24 < 26
    assert "blocking 766 ms = max(0, Tc - (Ti - Tw)) with Tw 500 ms" in run(
        *base, "--tw", "0.5").stdout


def test_plan_client_gbps_bounds_persist_and_load_and_says_which_bound_binds():
    state, nodes = 4.05e12, 2048
    storage = run_json(*LLAMA, "--client-gbps", "1")  # 2048 GB/s of clients: storage binds
    clients = run_json(*LLAMA, "--client-gbps", "0.001")  # 2.048 GB/s < 5 GB/s

    assert storage["persist_bound"] == "storage" and storage["persist_s"] == pytest.approx(810.0)
    assert clients["persist_bound"] == clients["load_bound"] == "clients"
    assert clients["persist_gbps"] == pytest.approx(nodes * 0.001)
    assert clients["persist_s"] == pytest.approx(state / (nodes * 0.001 * 1e9))
    assert clients["load_s"] == pytest.approx(clients["persist_s"])
    assert clients["checkfreq_interval_steps"] > storage["checkfreq_interval_steps"]
    assert clients["modes"]["async"]["goodput"] < storage["modes"]["async"]["goodput"]

    out = run(*LLAMA, "--client-gbps", "0.001").stdout
    assert ("persist (at 2.048 GB/s: the clients bind, 2048 nodes x 0.001 GB/s per client; "
            "storage 5 GB/s)") in out
    assert "the storage binds" in run(*LLAMA, "--client-gbps", "1").stdout


def test_plan_prints_checkfreq_rollback_bounds_2kti_and_kti():
    data = run_json(*LLAMA)
    k = data["checkfreq_interval_steps"]
    assert data["checkfreq_rollback_max_s"] == 2 * k * 5.0  # R_max = 2 k Ti
    assert data["checkfreq_rollback_avg_s"] == k * 5.0  # R_avg = k Ti, not 1.5 k Ti
    assert ("CheckFreq rollback per failure: R_max = 2 k Ti = 27.0 min, "
            "R_avg = k Ti = 13.5 min") in run(*LLAMA).stdout


@pytest.mark.parametrize("change,flag", [
    (["--storage-gbps", "0"], "--storage-gbps"),
    (["--storage-gbps", "-5"], "--storage-gbps"),
    (["--bytes-per-param", "-1"], "--bytes-per-param"),
    (["--ranks", "0"], "--ranks"),
    (["--iteration-s", "0"], "--iteration-s"),
    (["--mtbf-h", "-1"], "--mtbf-h"),
    (["--restart-s", "-3"], "--restart-s"),
    (["--client-gbps", "0"], "--client-gbps"),
    (["--interval", "1min"], "--interval"),  # a checkpoint takes 13.5 min to persist
    (["--interval", "2s"], "--interval"),  # shorter than a 5 s step
    (["--tw", "6"], "--tw"),  # longer than the step
    (["--tw", "1", "--stage-hidden", "0.5"], "--tw"),
    (["--sharding", "100"], "--sharding"),
    (["--budget", "150%"], "--budget"),
])
def test_plan_refuses_bad_inputs_in_one_line_naming_the_flag(change, flag):
    proc = run(*LLAMA, *change)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-plus plan: ") and flag in lines[0]
