"""The tested torch range and the private torch names of ``dcp_plus._compat.torch_dcp``: one
declared floor everywhere, a clear error naming the torch version for a missing name, and the
DefaultStager difference between releases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from dcp_plus import LocalReader, LocalWriter
from dcp_plus._compat import torch_dcp
from dcp_plus._compat.torch_dcp import (
    DEFAULT_STAGER_REUSABLE,
    TESTED_TORCH,
    ReusableDefaultStager,
    private,
)
from dcp_plus.errors import DcpPlusError, UnsupportedTorchError
from tests.conftest import assert_bit_exact

ROOT = Path(__file__).resolve().parents[2]


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_the_declared_floor_is_the_one_ci_tests_and_the_pin_is_the_top_of_the_range():
    low, high = TESTED_TORCH.split(" to ")
    pyproject = (ROOT / "pyproject.toml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^torch==([\d.]+)", (ROOT / "constraints.txt").read_text(), re.M)
    floor = re.search(r"^TORCH_FLOOR\s*:=\s*([\d.]+)", makefile, re.M)

    assert f'"torch>={low}"' in pyproject
    assert floor and _minor(floor.group(1)) == low
    assert pin and _minor(pin.group(1)) == high
    # part of `make test`, hence of .ci/run
    assert re.search(r"^\t\$\(MAKE\)[^\n]*\stest-torch-floor\b", makefile, re.M)


def test_a_missing_private_name_is_refused_naming_it_and_this_torch():
    with pytest.raises(UnsupportedTorchError) as info:
        private("torch.distributed.checkpoint._nested_dict", "no_such_helper")

    msg = str(info.value)
    assert "torch.distributed.checkpoint._nested_dict.no_such_helper" in msg
    assert torch.__version__ in msg and TESTED_TORCH in msg
    assert isinstance(info.value, DcpPlusError) and isinstance(info.value, ImportError)


def test_a_stand_in_for_a_missing_helper_raises_only_when_called():
    stand_in = torch_dcp._stand_in("torch.distributed.checkpoint._no_such_module", "f")

    with pytest.raises(UnsupportedTorchError, match="_no_such_module.f"):
        stand_in({"a": 1})


def test_the_names_dcp_plus_uses_all_resolve_on_this_torch():
    for fn in (torch_dcp.flatten_state_dict, torch_dcp.unflatten_state_dict,
               torch_dcp.set_element):
        assert fn.__module__.startswith("torch."), fn
    for get in (torch_dcp.fsspec_reader, torch_dcp.fsspec_writer, torch_dcp.storage_info):
        assert isinstance(get(), type)
    assert torch_dcp.process_daemon_class() is not None
    assert torch_dcp.EmptyStateDictLoadPlanner.__module__.startswith("torch.")


def _stage_twice(stager: DefaultStager) -> None:
    for i in range(2):
        stager.stage({"w": torch.full((4,), float(i))})


def test_default_stager_reusable_says_whether_a_default_stager_stages_twice():
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        if DEFAULT_STAGER_REUSABLE:
            _stage_twice(stager)
        else:
            with pytest.raises(KeyError):
                _stage_twice(stager)
    finally:
        stager.close()


def test_a_reusable_default_stager_saves_again_and_again_bit_exact(tmp_path):
    stager = ReusableDefaultStager(StagingOptions(False, True, True, False))
    try:
        for i in range(3):
            state = {"w": torch.randn(64, generator=torch.Generator().manual_seed(i)),
                     "step": i}
            resp = dcp.async_save(state, storage_writer=LocalWriter(tmp_path / str(i)),
                                  async_stager=stager, no_dist=True)
            resp.upload_completion.result()
            out = {"w": torch.zeros(64), "step": -1}
            dcp.load(out, storage_reader=LocalReader(tmp_path / str(i)), no_dist=True)
            assert_bit_exact(out, state)
    finally:
        stager.close()
