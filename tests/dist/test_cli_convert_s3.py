"""`dcp-plus convert` to and from an S3 URL (the SeaweedFS endpoint on 127.0.0.1), run as the
real command: local dcp_plus -> s3:// dcp_plus -> local stock DCP, bit-exact at the end."""

from __future__ import annotations

import json
import uuid

import pytest
import torch.distributed.checkpoint as dcp

from dcp_plus import LocalWriter
from tests.unit.test_cli_convert import assert_same, load_with_stock_torch_only, state
from tests.unit.test_cli_ls_diff import run
from tools.testkit.seaweed import BUCKET, SeaweedServer

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def options(seaweed: SeaweedServer) -> list[str]:
    out = []
    for key, value in seaweed.storage_options().items():
        out += ["--storage-option", f"{key}={json.dumps(value) if isinstance(value, dict) else value}"]
    return out


def test_convert_through_s3_is_bit_exact(seaweed: SeaweedServer, tmp_path) -> None:
    src = tmp_path / "ours"
    dcp.save(state(), storage_writer=LocalWriter(src), no_dist=True)
    url = f"s3://{BUCKET}/convert/{uuid.uuid4().hex[:12]}"
    proc = run("convert", str(src), url, "--to", "dcp_plus", *options(seaweed))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {url} (dcp_plus)" in proc.stdout

    again = run("convert", str(src), url, "--to", "dcp_plus", *options(seaweed))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr

    local = tmp_path / "stock"
    proc = run("convert", url, str(local), *options(seaweed))
    assert proc.returncode == 0, proc.stderr
    assert f"{url}: dcp_plus checkpoint" in proc.stdout
    assert_same(load_with_stock_torch_only(local, tmp_path / "sd.pt"), state())


def test_only_dcp_plus_is_written_to_a_url(seaweed: SeaweedServer, tmp_path) -> None:
    src = tmp_path / "ours"
    dcp.save(state(), storage_writer=LocalWriter(src), no_dist=True)
    url = f"s3://{BUCKET}/convert/{uuid.uuid4().hex[:12]}"
    proc = run("convert", str(src), url, "--to", "torch", *options(seaweed))
    assert proc.returncode == 2 and "writes local paths only" in proc.stderr
