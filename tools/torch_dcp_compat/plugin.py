"""pytest plugin: ``-p tools.torch_dcp_compat.plugin`` runs DCP's tests on dcp_plus.

Options: ``--dcp-compat=on|off`` (off: stock DCP, the baseline, with the same plugin loaded),
``--dcp-compat-stager=saver|all|none`` (see ``compat.apply``) and ``--dcp-compat-allow-cpu``
(run ``skip_if_lt_x_gpu``-gated tests on CPU, see ``gates``). The settings reach child
processes through the environment and ``_boot/sitecustomize.py``.
"""

from __future__ import annotations

import os

import pytest

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torch_dcp_compat")
    group.addoption("--dcp-compat", choices=("on", "off"), default="on",
                    help="replace DCP's stock classes with dcp_plus ones (default on)")
    group.addoption("--dcp-compat-stager", choices=("saver", "all", "none"), default="saver",
                    help="which DefaultStager to replace with ArenaStager (default: the one "
                         "async_save creates for itself)")
    group.addoption("--dcp-compat-allow-cpu", action="store_true",
                    help="run skip_if_lt_x_gpu-gated tests on a CPU-only machine")


def pytest_configure(config: pytest.Config) -> None:
    on = config.getoption("--dcp-compat") == "on"
    stager = config.getoption("--dcp-compat-stager")
    allow_cpu = config.getoption("--dcp-compat-allow-cpu")
    os.environ["TORCH_DCP_COMPAT"] = "1" if on else "0"
    os.environ["TORCH_DCP_COMPAT_STAGER"] = stager
    os.environ["TORCH_DCP_COMPAT_ALLOW_CPU"] = "1" if allow_cpu else "0"
    if on or allow_cpu:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if BOOT_DIR not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *paths])
    if allow_cpu:
        from tools.torch_dcp_compat.gates import open_gpu_gates

        open_gpu_gates()
    if on:
        from tools.torch_dcp_compat.compat import apply

        apply(stager)


def pytest_report_header(config: pytest.Config) -> str:
    mode = ("off (stock DCP)" if config.getoption("--dcp-compat") == "off"
            else f"on (stager={config.getoption('--dcp-compat-stager')})")
    gates = ", GPU gates open on CPU" if config.getoption("--dcp-compat-allow-cpu") else ""
    return f"torch_dcp_compat: {mode}{gates}"
