"""`dcp-plus plan`, run as the installed command would run it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dcp_plus.cli.main import main
from tests.conftest import ROOT, child_env

LLAMA = ["plan", "--params", "405B", "--bytes-per-param", "10", "--ranks", "16384",
         "--sharding", "128", "--storage-gbps", "5", "--iteration-s", "5", "--mtbf-h", "3"]


def test_plan_prints_the_llama3_figures(capsys):
    assert main(LLAMA) == 0
    out = capsys.readouterr().out

    assert "state: 4.05 TB (405B params x 10 B); 31.6 GB per rank" in out
    assert "persist (at 5 GB/s aggregate): 13.5 min" in out
    assert "peer replica: 506.2 GB" in out
    for mode in ("sync", "async", "tiered"):
        assert f"\n{mode} " in out


def test_plan_json_has_every_figure_in_the_unit_its_key_names(capsys):
    assert main([*LLAMA, "--budget", "5%", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)

    assert data["inputs"]["params"] == 405e9 and data["inputs"]["mtbf_s"] == 3 * 3600
    assert data["inputs"]["shard_degree"] == 128 and data["inputs"]["overhead_budget"] == 0.05
    assert data["persist_s"] == pytest.approx(810.0)
    assert data["host_memory_per_node_bytes"] == pytest.approx(506.25e9)
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
