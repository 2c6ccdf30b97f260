"""Child process of ``test_direct_io``'s full-disk test, run in its own mount namespace on a
small tmpfs: saves a checkpoint that fits, then one that does not, and prints what became of
both as JSON.

Usage: ``python -m tests.unit._full_disk_child DIR MODE`` (MODE: ``plain`` for ``dcp.save``
from tensor memory, ``buffered`` for the same with ``direct_io=False``, ``slab`` for an
``ArenaStager`` async save by the writer workers).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from dcp_plus import ArenaStager, LocalWriter
from tests.conftest import load, load_target
from tools.testkit.exact import assert_bit_exact

FITS = {f"w{i}": torch.full((1_000_000,), float(i)) for i in range(2)}  # 8 MB
TOO_BIG = {f"w{i}": torch.full((2_000_000,), float(i + 5)) for i in range(2)}  # 16 MB


def main(root: str, mode: str) -> int:
    dcp.save(FITS, storage_writer=LocalWriter(f"{root}/fits"), no_dist=True)
    error = ""
    try:
        if mode == "slab":
            with ArenaStager() as stager:
                resp = dcp.async_save(TOO_BIG, storage_writer=LocalWriter(f"{root}/full"),
                                      async_stager=stager)
                getattr(resp, "upload_completion", resp).result()
        else:
            dcp.save(TOO_BIG, no_dist=True, storage_writer=LocalWriter(
                f"{root}/full", direct_io=False if mode == "buffered" else "auto"))
    except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is one)
        error = str(e)
    assert_bit_exact(load(load_target(FITS), f"{root}/fits"), FITS)
    print(json.dumps({"error": error, "left": sorted(os.listdir(f"{root}/full"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
