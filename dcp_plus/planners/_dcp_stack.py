"""Is this pickle DCP's own plan gather or metadata broadcast? The one stack check left.

The plan cache's wire tokens must be used inside DCP's collectives only: the final metadata
broadcast carries a 16-byte key instead of the ``Metadata`` (which every other pickle, e.g. a
writer's commit record, must get in full), and a local plan keeps the bytes DCP's gather
received (a copy or another pickle must not). A reducer cannot tell who pickles it, and DCP
gives a planner no hook around its collectives, so :func:`in_dcp_collective` looks at the
calling frames for ``torch.distributed.checkpoint.utils._DistWrapper.<name>``. A DCP that
renames those methods falls back to stock behaviour (full metadata, plans pickled again).
"""

from __future__ import annotations

import sys
from types import FrameType

_DCP_UTILS = "torch.distributed.checkpoint.utils"


def in_dcp_collective(name: str, depth: int = 12) -> bool:
    """True when called (through pickling) from DCP's ``_DistWrapper.<name>``, e.g.
    ``broadcast_object`` or ``gather_object``."""
    f: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name == name and f.f_globals.get("__name__") == _DCP_UTILS:
            return True
        f = f.f_back
    return False
