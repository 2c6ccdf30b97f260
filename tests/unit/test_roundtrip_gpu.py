"""LocalWriter/LocalReader with CUDA tensors: saved from and loaded into device memory."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_bit_exact, build_state_dict, clone_state, load, load_target, save

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _to_cuda(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cuda()
    if isinstance(value, dict):
        return type(value)((k, _to_cuda(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_cuda(v) for v in value]
    return value


def _state() -> dict:
    sd = build_state_dict(seed=8)
    for name in ("uint16", "float8_e4m3fn"):  # barebones dtypes: few CUDA kernels
        del sd["dtypes"][name]
    return sd


def test_cuda_tensors_round_trip_bit_exact_into_cuda_and_cpu_targets(tmp_path):
    sd = _to_cuda(_state())
    expected = clone_state(sd)
    save(sd, tmp_path / "ckpt")

    on_gpu = load(load_target(expected), tmp_path / "ckpt")
    on_cpu = load(load_target(_state()), tmp_path / "ckpt")

    assert on_gpu["dtypes"]["float32"].device.type == "cuda"
    assert_bit_exact(on_gpu, expected)
    assert_bit_exact(_to_cuda(on_cpu), expected)
