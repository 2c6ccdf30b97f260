"""dcp_plus.integrations.torchtitan imports cleanly where TorchTitan is absent."""

from __future__ import annotations

import subprocess
import sys


def test_module_imports_without_torchtitan_and_names_the_extra() -> None:
    # a fresh interpreter where importing torchtitan fails, whether or not it is installed
    code = (
        "import importlib.util, sys\n"
        "orig = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'torchtitan' else orig(n, *a)\n"
        "sys.modules['torchtitan'] = None\n"
        "import dcp_plus.integrations.torchtitan as t\n"
        "assert t.TORCHTITAN_AVAILABLE is False\n"
        "try:\n"
        "    t.DcpPlusCheckpointManager\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "dcp-plus[torchtitan]" in out
