"""``DCPP_SHM_DIR``: every process of a job keeps its shared memory (slabs, memory-tier
snapshots) in the named directory, a restarted one finds it there, and a bad value is refused
naming it; ``huge_pages`` reads a tmpfs's ``huge=`` option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from dcp_plus.shm import ENV
from dcp_plus.shm import SHM_DIR as DEFAULT_DIR
from dcp_plus.storage.direct import huge_pages
from tests.conftest import child_env

_JOB = """
import io, json, os, sys, torch
from dcp_plus.manager import CheckpointManager
from dcp_plus.shm import SHM_DIR
root, job, mode = sys.argv[1:4]

def state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(257, 129, generator=g), "b": torch.arange(step, step + 7),
            "step": step, "blob": io.BytesIO(b"s%d" % step)}

m = CheckpointManager(root, memory_tier=True, durable_every=2, job_id=job, takeover=True)
if mode == "save":
    for s in (1, 2, 3):
        m.save(s, state(s)).result(timeout=60)
    m.close(keep_snapshots=True)
    print(json.dumps({"dir": SHM_DIR}))
else:
    st = state(0)
    step = m.load_latest(st)
    same = all(torch.equal(st[k], state(step)[k]) for k in ("w", "b"))
    same = same and st["blob"].getvalue() == b"s%d" % step
    print(json.dumps({"dir": SHM_DIR, "step": step, "tiers": m.last_restore.tiers,
                      "same": same}))
    m.close()
"""


def _run(root: Path, job: str, mode: str, shm: str) -> dict:
    env = {**child_env(), ENV: shm}
    out = subprocess.run([sys.executable, "-c", _JOB, str(root), job, mode], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _files_of(d: str, job: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if job in n)


def test_a_job_keeps_and_restores_its_snapshots_in_the_named_directory(tmp_path):
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="dcpp-test-shmdir-")
    job = f"s{uuid.uuid4().hex[:10]}"
    try:
        assert _run(tmp_path / "r", job, "save", shm)["dir"] == shm
        kept = _files_of(shm, job)
        assert kept, "the snapshot and its record are in the named directory"
        assert _files_of(DEFAULT_DIR, job) == []
        got = _run(tmp_path / "r", job, "restore", shm)
        assert (got["step"], got["tiers"], got["same"]) == (3, ["memory"], True)
        assert _files_of(shm, job) == []  # close() removed the job's snapshots there
        assert [n for n in os.listdir(shm) if n.startswith("dcpp-")] == []  # and the slabs
    finally:
        for n in os.listdir(shm):
            os.unlink(os.path.join(shm, n))
        os.rmdir(shm)


def test_a_directory_that_does_not_exist_is_refused_naming_the_variable(tmp_path):
    missing = str(tmp_path / "nowhere")
    out = subprocess.run([sys.executable, "-c", "import dcp_plus.memory.slabs"],
                         env={**child_env(), ENV: missing}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert f"{ENV}={missing!r}: not a directory" in out.stderr


@pytest.mark.parametrize(("fs", "options", "want"), [
    ("tmpfs", "rw,size=4194304k,huge=within_size", "within_size"),
    ("tmpfs", "rw,huge=always", "always"),
    ("tmpfs", "rw,huge=never", None),
    ("tmpfs", "rw,size=4194304k", None),
    ("ext4", "rw,huge=always", None),
])
def test_huge_pages_reads_the_tmpfs_option_of_the_mount_holding_the_path(tmp_path, fs, options,
                                                                          want):
    dev = os.stat(tmp_path).st_dev
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(textwrap.dedent(f"""\
        22 1 0:999 / /elsewhere rw,relatime shared:1 - tmpfs none rw,huge=always
        23 1 {os.major(dev)}:{os.minor(dev)} / /here rw,relatime shared:2 - {fs} src {options}
        """))
    assert huge_pages(str(tmp_path), str(mountinfo)) == want
    assert huge_pages(str(tmp_path), str(tmp_path / "no-such-table")) is None
