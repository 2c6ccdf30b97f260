"""What a user's own environment gets from ``pip install 'dcp-plus[s3]'``: run with the
Python of a fresh venv into which the built wheel was installed (``make test-install``).

Saves and loads through the stock entry points with the three plugins, on a local disk and
on an fsspec object store (the ``s3`` extra's fsspec path, in memory), and checks that the
package was imported from the wheel (not from a source tree) and that the command runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp

import dcp_plus
from dcp_plus import (
    ArenaStager,
    CachedSavePlanner,
    LocalReader,
    LocalWriter,
    ObjectStoreReader,
    ObjectStoreWriter,
    SafeLoadPlanner,
)


def main() -> int:
    where = os.path.dirname(dcp_plus.__file__)
    assert "site-packages" in where, f"dcp_plus imported from {where}, not the installed wheel"
    import s3fs  # noqa: F401  (the extra)

    sd = {"w": torch.randn(1000, 7), "step": torch.tensor(3)}
    with tempfile.TemporaryDirectory() as tmp, ArenaStager() as stager:
        resp = dcp.async_save(sd, storage_writer=LocalWriter(f"{tmp}/c"),
                              planner=CachedSavePlanner(), async_stager=stager, no_dist=True)
        resp.upload_completion.result()
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=LocalReader(f"{tmp}/c"), planner=SafeLoadPlanner(),
                 no_dist=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd), "local round trip differs"
    dcp.save(sd, storage_writer=ObjectStoreWriter("memory://install-check/c"), no_dist=True)
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=ObjectStoreReader("memory://install-check/c"),
             planner=SafeLoadPlanner(), no_dist=True)
    assert all(torch.equal(back[k], sd[k]) for k in sd), "object-store round trip differs"
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dcp-plus"),
                          "--version"], capture_output=True, text=True, check=True)
    print(f"install check: ok ({cli.stdout.strip()}, torch {torch.__version__}, from {where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
