"""TorchTitan integration: its checkpoint manager, saving and loading through dcp_plus.

Select it with one config change (see ``docs/torchtitan.md``)::

    --override.imports dcp_plus.integrations.torchtitan.use_dcp_plus

or, in a recipe (``--module my_recipes --config my_config``)::

    from dcp_plus.integrations.torchtitan import with_dcp_plus
    def my_config():
        return with_dcp_plus(llama3_8b(), stager_buffers=2)

This module imports without TorchTitan installed; its classes then raise ``ImportError``
naming the extra to install (``pip install 'dcp-plus[torchtitan]'``).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

__all__ = ["TORCHTITAN_AVAILABLE", "DcpPlusCheckpointManager", "SaveRecord", "use_dcp_plus",
           "with_dcp_plus"]

TORCHTITAN_AVAILABLE: bool = importlib.util.find_spec("torchtitan") is not None
"""Whether TorchTitan is importable in this environment."""

_MISSING = ("dcp_plus.integrations.torchtitan needs TorchTitan: pip install "
            "'dcp-plus[torchtitan]' (torchtitan==0.3.0)")

if TYPE_CHECKING or TORCHTITAN_AVAILABLE:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.config.override import derive, override

    from dcp_plus.integrations._titan_manager import DcpPlusCheckpointManager, SaveRecord

    @override(target=CheckpointManager.Config,
              description="dcp_plus: ArenaStager + CachedSavePlanner + dcp_plus writers/readers")
    def use_dcp_plus(cfg: CheckpointManager.Config,
                     **fields: Any) -> DcpPlusCheckpointManager.Config:
        """``--override.imports`` target: TorchTitan's checkpoint config -> dcp_plus's.

        Every field of the existing ``checkpoint`` config is kept; ``fields`` (from
        ``--override.imports 'dcp_plus.integrations.torchtitan.use_dcp_plus={...}'``) set
        the new ones, e.g. ``{"stager_buffers": 2, "compression": "zstd"}``.
        """
        return derive(cfg, DcpPlusCheckpointManager.Config, **fields)

    def with_dcp_plus(trainer_config: Any, **fields: Any) -> Any:
        """For recipes: ``trainer_config`` with its ``checkpoint`` switched to dcp_plus.

        Args:
            trainer_config: a ``torchtitan.trainer.Trainer.Config`` (changed in place and
                returned).
            fields: ``DcpPlusCheckpointManager.Config`` fields to set.
        """
        trainer_config.checkpoint = derive(trainer_config.checkpoint,
                                           DcpPlusCheckpointManager.Config, **fields)
        return trainer_config

else:

    def __getattr__(name: str) -> Any:
        if name in __all__:
            raise ImportError(f"{name}: {_MISSING}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
