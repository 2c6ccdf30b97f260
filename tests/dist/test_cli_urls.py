"""`dcp-plus inspect / verify / diff / ls` on s3:// (SeaweedFS) and nfs:// (nfs-ganesha)
locations, run as the real command in a subprocess, as on a local path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import NFSWriter, ObjectStoreWriter
from dcp_plus.manager import CheckpointManager
from tests.conftest import ROOT, run_cli, build_state_dict, child_env, flip_byte
from tools.testkit.ganesha import GaneshaServer
from tools.testkit.seaweed import BUCKET, SeaweedServer

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


run = run_cli  # in this process: no interpreter start-up per call


def option_flags(options: dict[str, Any]) -> list[str]:
    """``--storage-option K=V`` flags (JSON values) for ``options``."""
    flags = []
    for key, value in options.items():
        flags += ["--storage-option", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return flags


def largest_extent(record: dict[str, Any]) -> dict[str, Any]:
    return max(record["extents"], key=lambda e: e["length"])


@pytest.fixture
def s3(seaweed: SeaweedServer) -> tuple[str, dict[str, Any], list[str]]:
    """A fresh prefix, its storage options and the matching CLI flags."""
    opts = seaweed.storage_options()
    return f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:10]}", opts, option_flags(opts)


def test_inspect_verify_diff_on_s3_and_damage_found(s3) -> None:
    prefix, opts, flags = s3
    a, b = f"{prefix}/a", f"{prefix}/b"
    sd = build_state_dict()
    dcp.save(sd, storage_writer=ObjectStoreWriter(a, opts), no_dist=True)
    changed = dict(sd, extra=torch.arange(7))
    dcp.save(changed, storage_writer=ObjectStoreWriter(b, opts), no_dist=True)

    import fsspec

    fs, root = fsspec.core.url_to_fs(a, **opts)
    record = json.loads(fs.cat_file(f"{root}/.metadata"))
    info = run("inspect", a, *flags, "--json")
    assert info.returncode == 0, info.stderr
    assert {r["name"] for r in json.loads(info.stdout)["items"]} == set(record["items"])
    ok = run("verify", a, *flags)
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("OK"), ok.stdout + ok.stderr
    stray = "__0_0." + "f" * 16 + ".dcpp"  # an object of a save that did not commit
    fs.pipe_file(f"{root}/{stray}", b"x" * 10)
    listed = run("verify", a, *flags, "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert json.loads(listed.stdout)["stray"] == [{"file": stray, "bytes": 10}], listed.stdout
    fs.rm_file(f"{root}/{stray}")
    diff = run("diff", a, b, *flags, "--json")
    assert diff.returncode == 1 and json.loads(diff.stdout)["added"] == ["extra"], diff.stdout

    ext = largest_extent(record)
    data = bytearray(fs.cat_file(f"{root}/{ext['file']}"))
    data[ext["offset"] + 5] ^= 0xFF
    fs.pipe_file(f"{root}/{ext['file']}", bytes(data))
    bad = run("verify", a, *flags, "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    (problem,) = json.loads(bad.stdout)["problems"]
    assert problem.startswith(ext["file"]) and repr(ext["fqn"]) in problem, problem


def test_a_url_without_its_options_or_a_local_path_with_options_is_a_clear_input_error(
        s3, tmp_path: Path) -> None:
    prefix, opts, flags = s3
    dcp.save({"w": torch.ones(4)}, storage_writer=ObjectStoreWriter(f"{prefix}/a", opts),
             no_dist=True)
    missing = run("verify", f"{prefix}/nothing-here", *flags)
    assert missing.returncode == 2 and "no commit record" in missing.stderr, missing.stderr
    local = run("inspect", str(tmp_path), *flags)
    assert local.returncode == 2 and "apply to URLs only" in local.stderr, local.stderr


def test_ls_lists_a_manager_root_on_s3(s3) -> None:
    prefix, opts, flags = s3
    with CheckpointManager(prefix, interval=1, storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((64,), float(step))})
            mgr.wait()
    proc = run("ls", prefix, *flags, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [r["step"] for r in info["checkpoints"]] == [1, 2] and info["latest"] == 2
    assert all(r["committed"] and r["tensors"] == 1 for r in info["checkpoints"])


def test_inspect_verify_convert_diff_over_nfs_and_damage_done_on_the_server(
        ganesha: GaneshaServer, tmp_path: Path) -> None:
    rel = f"t/cli-{uuid.uuid4().hex[:10]}"
    target = f"{ganesha.url}/{rel}{ganesha.query()}"
    dcp.save(build_state_dict(), storage_writer=NFSWriter(target), no_dist=True)
    assert run("inspect", target).returncode == 0
    assert run("verify", target).returncode == 0
    copy = tmp_path / "copy"
    converted = run("convert", target, str(copy), "--to", "dcp_plus")
    assert converted.returncode == 0, converted.stderr
    same = run("diff", target, str(copy))
    assert same.returncode == 0 and " 0 changed" in same.stdout, same.stdout
    on_server = Path(ganesha.export_dir, rel)
    record = json.loads((on_server / ".metadata").read_bytes())
    ext = largest_extent(record)
    flip_byte(on_server / ext["file"], ext["offset"] + 3)
    bad = run("verify", target)
    assert bad.returncode == 1 and ext["file"] in bad.stdout, bad.stdout
    assert "FAILED (1 problem)" in bad.stdout
    assert os.fspath(on_server) not in bad.stdout  # named relative to the checkpoint
