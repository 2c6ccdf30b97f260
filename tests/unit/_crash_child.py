"""Child process of ``test_crash``: commits checkpoint v1, then is SIGKILLed writing v2.

Usage: ``python -m tests.unit._crash_child OLD_DIR NEW_DIR READY_FILE GO_FILE``. After v1 is
committed it creates READY_FILE (its writer workers are then running) and waits for GO_FILE
before saving v2 into NEW_DIR (``overwrite=True``; NEW_DIR may equal OLD_DIR). It creates
READY_FILE + ".finished" if that save ever completes.
"""

from __future__ import annotations

import sys
from pathlib import Path

SLAB_BYTES = 24 << 20
PIECES = 3


def v1_state(bufs: list) -> dict:
    """v1's state over two uint8 buffers (slabs in the child, plain tensors in the test)."""
    from tests.conftest import carve, fill_pattern

    fill_pattern(bufs[0], seed=1)
    fill_pattern(bufs[1], seed=2)
    return {**carve(bufs[0], "a", PIECES), **carve(bufs[1], "b", PIECES)}


def main(old: str, new: str, ready: str, go: str) -> int:
    from tests.conftest import fill_pattern, registered_slab, save, wait_for_file

    with registered_slab(SLAB_BYTES) as s1, registered_slab(SLAB_BYTES) as s2:
        bufs = [s1.tensor(), s2.tensor()]
        sd = v1_state(bufs)
        save(sd, old)
        Path(ready).touch()
        if not wait_for_file(go):
            return 3
        fill_pattern(bufs[0], seed=3)
        fill_pattern(bufs[1], seed=4)
        save(sd, new, overwrite=True)
        Path(ready + ".finished").touch()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
