"""A tiny FSDP2/HSDP training setup shared by the end-to-end cases and the single-process load.

Every rank uses the *same* global batch each step, so the forward loss does not depend on the
world size or the mesh: a checkpoint loaded at 4, 2 or 1 ranks must reproduce the next step's
loss bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 12, 10, 6, 16  # 10 and 6 rows split unevenly over 4 ranks


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT))


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` each Linear and the root on ``mesh`` (1-D: FSDP, 2-D: HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # gloo has no PREMUL_SUM (ENVIRONMENT.md, pitfall 3)
    model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One step on the global batch of ``step``; returns the loss of its forward pass."""
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def forward_loss(model: nn.Module, step: int) -> float:
    """The loss step ``step`` would report, without updating anything."""
    x, y = batch(step)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y).item())


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def apply_state(model: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def flat_tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{dcp fqn: full tensor}`` for every tensor; DTensors are all-gathered (a collective)."""
    from dcp_plus._compat.torch_dcp import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(sd)
    out = {}
    for k, v in flat.items():
        if isinstance(v, DTensor):
            out[k] = v.full_tensor().detach().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
    return out
