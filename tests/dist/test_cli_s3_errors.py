"""`dcp-plus bench` against a real S3 server (SeaweedFS): wrong credentials are refused
before any work, in one line; right ones pass the probe, which leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import fsspec
import pytest

from dcp_plus.cli.bench.preflight import check_url_target
from dcp_plus.errors import DcpPlusError
from tests.conftest import ROOT, child_env
from tools.testkit.seaweed import BUCKET

pytestmark = pytest.mark.timeout(180)


def test_bench_with_wrong_credentials_exits_2_in_one_line(seaweed):
    opts = seaweed.storage_options(secret="not-the-secret")
    argv = [sys.executable, "-m", "dcp_plus", "bench", "--quick", "--target",
            f"s3://{BUCKET}/bench", "--storage-option", f"endpoint_url={opts['endpoint_url']}",
            "--storage-option", f"key={opts['key']}", "--storage-option", "secret=not-the-secret"]
    proc = subprocess.run(argv, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"dcp-plus bench: --target s3://{BUCKET}/bench: cannot write "
                               "there"), lines[0]
    assert proc.stdout == ""


def test_the_probe_passes_with_the_right_credentials_and_leaves_nothing(seaweed):
    opts = seaweed.storage_options()
    check_url_target(f"s3://{BUCKET}/probe-here", opts)
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    assert [p for p in fs.find(BUCKET) if ".dcpp-bench-probe-" in p] == []  # removed
    with pytest.raises(DcpPlusError, match="cannot write there"):  # an unknown access key
        check_url_target(f"s3://{BUCKET}/probe-here", seaweed.storage_options(key="nobody"))
