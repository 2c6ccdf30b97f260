"""Child process of the S3 kill test: commits v1, then is SIGKILLed while its writer workers
upload v2 (held in a slab).

Usage: ``python -m tests.dist._s3_kill_child OPTS_JSON OLD_URL NEW_URL READY GO``. After v1
is committed to OLD_URL it creates READY and waits for GO before saving v2 into NEW_URL
(``overwrite=True``; NEW_URL may equal OLD_URL). It creates READY + ".finished" if that save
ever completes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MiB = 1 << 20
PART = 5 * MiB


def v_state(seed: int) -> dict[str, Any]:
    """A state dict whose big tensor is a multipart upload of several parts."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(4 * MiB, generator=g),  # 16 MiB: 4 parts of 5 MiB
            "small": torch.randn(100, 7, generator=g), "step": seed}


def main(opts_json: str, old: str, new: str, ready: str, go: str) -> int:
    import torch.distributed.checkpoint as dcp

    import torch

    from dcp_plus import ObjectStoreWriter
    from tests.conftest import registered_slab, wait_for_file

    opts = json.loads(opts_json)
    dcp.save(v_state(1), storage_writer=ObjectStoreWriter(old, opts, part_size=PART))
    Path(ready).touch()
    if not wait_for_file(go):
        return 3
    with registered_slab(32 * MiB) as slab:  # v2 in a slab: uploaded by the worker pool
        v2 = v_state(2)
        big = slab.tensor()[: v2["big"].nbytes].view(torch.float32)
        big.copy_(v2["big"])
        dcp.save({**v2, "big": big}, storage_writer=ObjectStoreWriter(
            new, opts, part_size=PART, overwrite=True))
    Path(ready + ".finished").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
