"""Arms the torch_dcp_compat patches in child processes (spawned test ranks, DCP's
PROCESS-mode daemon): each is applied as soon as the child imports the module it patches.

The pytest plugin puts this directory on ``PYTHONPATH`` and sets ``TORCH_DCP_COMPAT`` /
``TORCH_DCP_COMPAT_ALLOW_CPU``; other processes (e.g. dcp_plus writer workers, which must
start without torch) import nothing heavy.
"""

import os
import sys

if "1" in (os.environ.get("TORCH_DCP_COMPAT"), os.environ.get("TORCH_DCP_COMPAT_ALLOW_CPU")):
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    if _root not in sys.path:
        sys.path.append(_root)
    from tools.torch_dcp_compat._hook import install

    install()
