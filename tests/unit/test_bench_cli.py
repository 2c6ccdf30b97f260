"""`dcp-plus bench`: a quick run writes every row and ratio; arguments are checked."""

from __future__ import annotations

import json
import math

import pytest

from dcp_plus.cli.bench.cases import DCP_DEFAULT, DCP_TUNED, PLUS
from dcp_plus.cli.bench.config import parse_size, parse_storage_options
from dcp_plus.cli.bench.limits import STREAMS
from dcp_plus.cli.bench.measure import merge_ranks
from dcp_plus.cli.bench.plot import have_matplotlib
from dcp_plus.cli.bench.report import DIRECT_ROWS, LIMITS
from dcp_plus.cli.main import main
from dcp_plus.shm import SHM_DIR


def _finite(v: object) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_quick_bench_writes_every_row_with_ratios_json_and_plot(tmp_path, capfd):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    (tmp_path / "disk").mkdir()
    rc = main(["bench", "--quick", "--size", "64MiB", "--target", str(tmp_path / "disk"),
               "--saves", "2", "--timeline-steps", "12", "--json", str(out), "--plot", str(png)])
    captured = capfd.readouterr()  # the file descriptors: DCP's PROCESS daemon writes there
    assert rc == 0, captured.err
    assert f"shared memory: {SHM_DIR} (" in captured.out  # where the slabs are, and their pages
    res = json.loads(out.read_text())
    rows = res["rows"]
    state_mib = res["state"]["bytes"] / 2**20
    assert {LIMITS, DCP_DEFAULT, DCP_TUNED, PLUS, *DIRECT_ROWS} <= set(rows)
    for name, row in rows.items():
        for key in ("persist_s", "load_s", "save_GBps", "load_GBps"):
            assert _finite(row[key]), (name, key, row[key])
        if name not in DIRECT_ROWS:
            assert _finite(row["staging_s"]), (name, row["staging_s"])
        # ext4 takes O_DIRECT: every row has both x direct ratios
        assert set(row["x_direct"]) == {"persist", "load"}, (name, row["x_direct"])
        assert all(_finite(v) for v in row["x_direct"].values()), (name, row["x_direct"])
        assert all(_finite(v) for v in row["x_limit"].values()), (name, row["x_limit"])
        if row["kind"] != "limit":
            assert len(row["saves"]) == 2
            assert row["peak_extra_MiB"] >= 0, (name, row["peak_extra_MiB"])
            assert all(_finite(v) for v in row["x_dcp"].values()), (name, row["x_dcp"])
            for key in ("cache_after_save_pct", "cache_after_load_pct"):
                assert 0 <= row[key] <= 100, (name, key, row[key])
            assert row["cache_method"] == "mincore"
    # the O_DIRECT limits: one row per stream count; the best of them is the x direct limit
    lim = res["limits"]
    assert lim["direct_refused"] is None
    assert [(rows[n]["streams"], rows[n]["huge_pages"]) for n in DIRECT_ROWS] == \
        [(k, False) for k in STREAMS] + [(k, True) for k in STREAMS]
    for op, col in (("write", "persist_s"), ("read", "load_s")):
        assert lim[f"direct_{op}_s"] == min(rows[n][col] for n in DIRECT_ROWS)
        best = rows[lim[f"direct_{op}_row"]]
        assert best[col] == lim[f"direct_{op}_s"]
        assert best["streams"] == lim[f"direct_{op}_streams"]
    assert min(rows[n]["x_direct"]["persist"] for n in DIRECT_ROWS) == pytest.approx(1.0)
    assert min(rows[n]["x_direct"]["load"] for n in DIRECT_ROWS) == pytest.approx(1.0)
    assert rows[PLUS]["x_direct"]["persist"] == pytest.approx(
        rows[PLUS]["persist_s"] / lim["direct_write_s"])
    assert res["ratios"]["dcp_plus load / O_DIRECT read limit"] == pytest.approx(
        rows[PLUS]["load_s"] / lim["direct_read_s"])
    # a load evicts nothing behind itself: a buffered reader leaves its file pages cached
    assert rows[DCP_DEFAULT]["cache_after_load_pct"] > 50, rows[DCP_DEFAULT]
    # The stock stagers' copies live only while a save runs, so a sampler can miss them; our
    # arena stays for the next save, so its full copy shows, and only once: it is reused.
    assert state_mib / 2 <= rows[PLUS]["peak_extra_MiB"] < 4 * state_mib, \
        rows[PLUS]["peak_extra_MiB"]
    assert rows[DCP_DEFAULT]["x_dcp"]["persist_s"] == pytest.approx(1.0)
    assert rows[PLUS]["x_dcp"]["persist_s"] == pytest.approx(
        rows[PLUS]["persist_s"] / rows[DCP_DEFAULT]["persist_s"])
    assert all(_finite(v) for v in res["ratios"].values()), res["ratios"]
    assert "dcp_plus persist / durable-write limit" in res["ratios"]
    runs = res["timeline"]["runs"]
    assert set(runs) == {"no checkpoints", "dcp: async_save default", "dcp_plus"}
    for name in ("dcp: async_save default", "dcp_plus"):
        assert len(runs[name]["checkpoints"]) == 2
        for c in runs[name]["checkpoints"]:
            assert c["call"] <= c["returned"] <= c["staged"] <= c["persisted"]
    for name in rows:  # the table names every row
        assert name in captured.out
    if have_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "matplotlib is not installed" in captured.err
    assert not list((tmp_path / "disk").iterdir()), "the run left checkpoints behind"
    # stderr is no terminal here: no bars; the daemon's INFO lines stay out at WARNING
    assert "\r" not in captured.err and "Checkpoint background process" not in captured.err, \
        captured.err


def test_bad_size_exits_2_with_a_message(capsys):
    assert main(["bench", "--size", "lots"]) == 2
    assert "not a size: 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize("text,expected", [("64MiB", 64 << 20), ("2GiB", 2 << 30),
                                           ("1.5GB", 1_500_000_000), ("4096", 4096)])
def test_sizes_parse_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


def test_storage_options_pass_through_with_bools_and_ints():
    assert parse_storage_options(["endpoint_url=http://h:1", "anon=true", "max_pool=8"]) == {
        "endpoint_url": "http://h:1", "anon": True, "max_pool": 8}
    assert parse_storage_options(["key=1234", "secret=true", "token=null"]) == {
        "key": "1234", "secret": "true", "token": "null"}  # credentials stay strings
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_storage_options(["novalue"])


def test_ranks_merge_to_the_slowest_time_and_the_summed_bytes():
    def rank(scale: float) -> dict:
        return {"nbytes": 100, "limits": {"memcpy_s": scale, "write_s": scale, "read_s": scale,
                                          "direct_refused": None, "direct2_write_s": scale},
                "order": ["c"], "kinds": {"c": "dcp"}, "shape": {}, "fs": "x",
                "cases": {"c": {"saves": [{"blocking_s": scale, "staging_s": scale,
                                           "persist_s": scale, "cache_after_save": scale / 10}],
                                "load_s": scale, "cache_after_load": scale / 10,
                                "peak_extra_bytes": 10, "load1": 0.0,
                                "foreign_cores": 0.0, "cold": "x"}}}

    merged = merge_ranks([rank(1.0), rank(3.0)])
    assert merged["nbytes"] == 200 and merged["ranks"] == 2
    assert merged["limits"]["write_s"] == 3.0
    assert merged["limits"]["direct2_write_s"] == 3.0 and merged["limits"]["direct_refused"] is None
    c = merged["cases"]["c"]
    assert c["saves"][0]["persist_s"] == 3.0 and c["load_s"] == 3.0
    assert c["saves"][0]["cache_after_save"] == 0.3 and c["cache_after_load"] == 0.3
    assert c["peak_extra_bytes"] == 20
