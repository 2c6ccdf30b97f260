"""A GPT-2-like model + AdamW optimizer state dict of a chosen size, for benchmarks and tests.

The layout follows GPT-2 (``transformer.wte``/``wpe``, per layer ``ln_1``, ``attn.c_attn``,
``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, then ``ln_f``; ``lm_head`` tied to
``wte``) with bf16 parameters and AdamW state (fp32 ``exp_avg``/``exp_avg_sq`` and a scalar fp32
``step`` per parameter), shaped like ``torch.optim.AdamW.state_dict()`` keyed by parameter name,
as ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns it::

    {"model": {fqn: bf16 tensor},
     "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}

With 24 layers and 10 bytes per parameter (2 bf16 + 4 + 4), 2 GiB is ``d_model`` 768
(GPT-2 small width at GPT-2 medium depth, ~210M parameters) and 1,168 tensors.

Use :func:`gpt2_like_state_dict` for the filled dict, :func:`gpt2_like_shapes` for the
shapes alone, and :func:`empty_like_state_dict` for a load destination.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 50257
CONTEXT = 1024
LAYERS = 24
PARAM_DTYPE = torch.bfloat16
MOMENT_DTYPE = torch.float32
_BYTES_PER_PARAM = PARAM_DTYPE.itemsize + 2 * MOMENT_DTYPE.itemsize


@dataclass(frozen=True)
class ModelShape:
    """GPT-2-like dimensions."""

    d_model: int
    layers: int = LAYERS
    vocab: int = VOCAB
    context: int = CONTEXT

    def params(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """``(fqn, shape)`` of every parameter, in ``named_parameters()`` order."""
        d = self.d_model
        yield "transformer.wte.weight", (self.vocab, d)
        yield "transformer.wpe.weight", (self.context, d)
        for i in range(self.layers):
            p = f"transformer.h.{i}."
            yield p + "ln_1.weight", (d,)
            yield p + "ln_1.bias", (d,)
            yield p + "attn.c_attn.weight", (3 * d, d)
            yield p + "attn.c_attn.bias", (3 * d,)
            yield p + "attn.c_proj.weight", (d, d)
            yield p + "attn.c_proj.bias", (d,)
            yield p + "ln_2.weight", (d,)
            yield p + "ln_2.bias", (d,)
            yield p + "mlp.c_fc.weight", (4 * d, d)
            yield p + "mlp.c_fc.bias", (4 * d,)
            yield p + "mlp.c_proj.weight", (d, 4 * d)
            yield p + "mlp.c_proj.bias", (d,)
        yield "transformer.ln_f.weight", (d,)
        yield "transformer.ln_f.bias", (d,)

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in self.params())

    @property
    def nbytes(self) -> int:
        """Tensor bytes of model + optimizer state (scalar ``step`` tensors included)."""
        n_params = sum(1 for _ in self.params())
        return self.num_params * _BYTES_PER_PARAM + n_params * MOMENT_DTYPE.itemsize

    @property
    def num_tensors(self) -> int:
        return 4 * sum(1 for _ in self.params())


def shape_for_size(size_bytes: float, layers: int = LAYERS) -> ModelShape:
    """The shape with ``layers`` layers whose state dict is closest to ``size_bytes``.

    ``d_model`` is a multiple of 64 (at least 64).
    """
    best = ModelShape(64, layers)
    for d in range(64, 16385, 64):
        s = ModelShape(d, layers)
        if abs(s.nbytes - size_bytes) < abs(best.nbytes - size_bytes):
            best = s
        if s.nbytes > size_bytes:
            break
    return best


def adamw_param_groups(shape: ModelShape) -> list[dict[str, Any]]:
    """AdamW's two parameter groups (decay, no decay) for ``shape``, as an optimizer
    state dict lists them."""
    names = [n for n, _ in shape.params()]
    decay = [n for n in names if n.endswith(".weight") and ".ln_" not in n]
    no_decay = [n for n in names if n not in set(decay)]
    common = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False,
              "foreach": None, "maximize": False, "capturable": False,
              "differentiable": False, "fused": None}
    return [dict(common, weight_decay=0.1, params=decay),
            dict(common, weight_decay=0.0, params=no_decay)]


def gpt2_like_state_dict(shape: ModelShape | None = None, *, size_gib: float = 2.0,
                         seed: int = 0, fill: bool = True) -> dict[str, Any]:
    """A ``{"model": ..., "optim": ...}`` state dict (see the module docstring).

    Args:
        shape: dimensions; by default the shape closest to ``size_gib`` GiB.
        seed: for the random contents (weights ~ N(0, 0.02), moments of matching scale).
        fill: random contents (default); ``False`` gives zeros (still written to every page,
            so the memory is faulted in and timings do not include first-touch costs).
    """
    shape = shape or shape_for_size(size_gib * 2**30)
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, s in shape.params():
        if fill:
            w = torch.empty(s, dtype=PARAM_DTYPE)
            w.normal_(0.0, 0.02, generator=gen)
            m = torch.empty(s, dtype=MOMENT_DTYPE).normal_(0.0, 1e-3, generator=gen)
            v = torch.empty(s, dtype=MOMENT_DTYPE).uniform_(0.0, 1e-6, generator=gen)
        else:
            w = torch.zeros(s, dtype=PARAM_DTYPE)
            m = torch.zeros(s, dtype=MOMENT_DTYPE)
            v = torch.zeros(s, dtype=MOMENT_DTYPE)
        model[fqn] = w
        state[fqn] = {"step": torch.tensor(1000.0 if fill else 0.0), "exp_avg": m,
                      "exp_avg_sq": v}
    return {"model": model, "optim": {"state": state, "param_groups": adamw_param_groups(shape)}}


def empty_like_state_dict(sd: Any) -> Any:
    """A zero-filled (pre-faulted) copy of ``sd``'s structure: a load destination."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: empty_like_state_dict(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [empty_like_state_dict(v) for v in sd]
    return sd


def iter_tensors(sd: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted path, tensor)`` for every tensor in a nested dict/list, in insertion order."""
    if isinstance(sd, torch.Tensor):
        yield prefix, sd
    elif isinstance(sd, dict):
        for k, v in sd.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def map_tensors(sd: Any, fn: Any) -> Any:
    """``sd`` with every tensor replaced by ``fn(tensor)`` (same nesting)."""
    if isinstance(sd, torch.Tensor):
        return fn(sd)
    if isinstance(sd, dict):
        return {k: map_tensors(v, fn) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(map_tensors(v, fn) for v in sd)
    return sd


def state_dict_nbytes(sd: Any) -> int:
    """Total tensor bytes."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(sd))


def states_equal(a: Any, b: Any) -> bool:
    """Bit-exact equality of two state dicts' tensors and non-tensor values."""
    ta, tb = dict(iter_tensors(a)), dict(iter_tensors(b))
    if ta.keys() != tb.keys():
        return False
    for k, x in ta.items():
        y = tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8),
                           y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8)):
            return False
    return True
