"""TorchTitan recipe (``--module tools.testkit.titan.recipe --config NAME``) for CPU test runs.

The llama3 debug model (6 layers, dim 256, vocab 2048) with causal SDPA attention instead of
FlexAttention (compiled block masks; documents are not masked from each other here), FSDP over 2 gloo ranks with SUM gradient reductions (gloo has no PREMUL_SUM)
and the ``partial_dtensor`` SPMD backend. Paths come from the command line
(``--hf_assets_path``, ``--dataloader.dataset_path``, ``--dump_folder``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.config import TrainingConfig
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from dcp_plus.integrations.torchtitan import with_dcp_plus


def _sum_reductions(parallelize_fn: Any) -> Any:
    def parallelize(model: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        out = parallelize_fn(model, *args, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return out

    return parallelize


def stock_cpu() -> Trainer.Config:
    """The debug model on CPU with TorchTitan's own checkpoint manager."""
    config = llama3_debugmodel()
    spec = model_registry("debugmodel")
    for _, _, parent, attr in spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # causal, no block mask
    config.model_spec = dataclasses.replace(
        spec, parallelize_fn=_sum_reductions(spec.parallelize_fn))
    config.training = TrainingConfig(local_batch_size=2, seq_len=64, steps=12, max_norm=1.0)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.data_parallel_shard_degree = -1
    config.activation_checkpoint = None  # type: ignore[assignment]
    config.validator.enable = False
    config.metrics.log_freq = 1
    config.checkpoint.enable = True
    config.checkpoint.interval = 3
    config.checkpoint.keep_latest_k = 0
    config.checkpoint.last_save_model_only = True
    config.compile.enable = False
    config.debug.seed = 1234  # the same initial weights in every run
    return config


def dcp_plus_cpu() -> Trainer.Config:
    """Same, checkpointing through dcp_plus (the recipe form of selecting it)."""
    return with_dcp_plus(stock_cpu(), async_mode="async", fsync=False)


def dcp_plus_incremental_cpu() -> Trainer.Config:
    """dcp_plus with incremental checkpoints (XOR deltas against the previous snapshot, two
    stager buffers) and TorchTitan's purge keeping the 2 newest step folders (its least)."""
    config = with_dcp_plus(stock_cpu(), async_mode="async", fsync=False, stager_buffers=2,
                           incremental=True, incremental_delta=True)
    config.checkpoint.keep_latest_k = 2
    return config
