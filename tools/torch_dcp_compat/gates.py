"""Open the ``skip_if_lt_x_gpu`` gates on a CPU-only machine.

Most of DCP's multi-rank tests are gated on GPU count although many only need
``self.device_type`` (``"cpu"`` there) and gloo. torch's own gate has an ``allow_cpu`` switch;
this forces it on, so those tests run on CPU in both the patched and the stock run (tests that
really need CUDA then fail in both, and drop out of the comparison).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def open_gpu_gates() -> None:
    """Make ``common_distributed.skip_if_lt_x_gpu(x)`` behave as ``(x, allow_cpu=True)``.

    Must run before the test helpers that bind the name (``common_dtensor``) are imported.
    """
    import torch.testing._internal.common_distributed as cd

    original = cd.skip_if_lt_x_gpu
    if getattr(original, "_dcp_compat", False):
        return

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Callable[[Any], Any]:
        return original(x, allow_cpu=True)

    skip_if_lt_x_gpu._dcp_compat = True  # type: ignore[attr-defined]
    cd.skip_if_lt_x_gpu = skip_if_lt_x_gpu
