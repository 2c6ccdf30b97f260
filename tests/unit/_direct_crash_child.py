"""Child process of ``test_direct_io``'s kill -9 test: overwrites one checkpoint with step
1, 2, 3, ... (plain ``dcp.save``: the bounce-buffer path, ``direct_io=True``) until killed.

Usage: ``python -m tests.unit._direct_crash_child CKPT``.
"""

from __future__ import annotations

import sys

import torch

PIECES = 5
PIECE_BYTES = (7 << 20) + 4097


def state(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s state: odd-sized tensors whose bytes depend on the step."""
    gen = torch.Generator().manual_seed(step)
    sd = {f"w{i}": torch.randint(0, 256, (PIECE_BYTES + i,), dtype=torch.uint8, generator=gen)
          for i in range(PIECES)}
    sd["step"] = torch.tensor(step, dtype=torch.int64)
    return sd


def main(ckpt: str) -> int:
    from tests.conftest import save

    step = 1
    while True:
        save(state(step), ckpt, overwrite=True, direct_io=True)
        step += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
