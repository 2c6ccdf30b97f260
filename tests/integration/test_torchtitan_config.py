"""DcpPlusCheckpointManager.Config, the override and the recipe helper (needs TorchTitan)."""

from __future__ import annotations

import re
import types

import pytest

pytest.importorskip(
    "torchtitan",
    reason="TorchTitan is not installed (pip install 'dcp-plus[torchtitan]', torchtitan==0.3.0)")


def test_override_keeps_every_torchtitan_field_and_sets_new_ones() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_plus.integrations.torchtitan import DcpPlusCheckpointManager, use_dcp_plus

    stock = CheckpointManager.Config(enable=True, interval=7, keep_latest_k=3, load_step=14,
                                     exclude_from_loading=["dataloader"],
                                     async_mode="async")
    cfg = use_dcp_plus(stock, stager_buffers=2, compression="zstd")
    assert type(cfg) is DcpPlusCheckpointManager.Config
    assert (cfg.interval, cfg.keep_latest_k, cfg.load_step) == (7, 3, 14)
    assert cfg.exclude_from_loading == ["dataloader"] and cfg.async_mode == "async"
    assert (cfg.stager_buffers, cfg.compression, cfg.planner) == (2, "zstd", "cached")
    assert cfg._owner is DcpPlusCheckpointManager


def test_override_json_sets_the_adaptive_budget() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_plus.integrations.torchtitan import use_dcp_plus

    cfg = use_dcp_plus(CheckpointManager.Config(enable=True, interval=500),
                       adaptive_budget=0.05, adaptive_warmup=3)
    assert (cfg.adaptive_budget, cfg.adaptive_warmup, cfg.interval) == (0.05, 3, 500)


@pytest.mark.parametrize("bad", [{"stager_buffers": 3}, {"plan_cache_size": 0},
                                 {"compression": "lz4"}, {"adaptive_budget": 1.5},
                                 {"adaptive_budget": 0.05, "adaptive_warmup": 0},
                                 {"writer": "local", "folder": "s3://b/run"},
                                 {"stager_device_copy": "sometimes"},
                                 {"writer_max_bytes_per_s": 0},
                                 {"writer_max_bytes_per_s": float("inf")},
                                 {"writer_stagger": -0.5}])
def test_invalid_settings_are_refused_at_config_time(bad: dict) -> None:
    from dcp_plus.integrations.torchtitan import DcpPlusCheckpointManager

    with pytest.raises(ValueError, match="checkpoint\\."):
        DcpPlusCheckpointManager.Config(enable=True, **bad)


def test_recipe_helper_switches_the_trainer_checkpoint_config() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_plus.integrations.torchtitan import DcpPlusCheckpointManager, with_dcp_plus

    # a Trainer.Config stand-in: importing torchtitan.trainer needs triton on CPU machines
    trainer_cfg = types.SimpleNamespace(
        checkpoint=CheckpointManager.Config(last_save_model_only=False))
    cfg = with_dcp_plus(trainer_cfg, fsync=False)
    assert isinstance(cfg.checkpoint, DcpPlusCheckpointManager.Config)
    assert cfg.checkpoint.last_save_model_only is False  # the recipe's own value is kept
    assert cfg.checkpoint.fsync is False


def test_override_json_sets_the_memory_and_peer_tiers() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_plus.integrations.torchtitan import use_dcp_plus
    from dcp_plus.tiers import TierOptions

    cfg = use_dcp_plus(CheckpointManager.Config(enable=True, async_mode="async"),
                       memory_tier=True, durable_every=4, peer_tier=True, ranks_per_node=8,
                       job_id="run.7", memory_tier_bytes=1 << 30)
    assert cfg.tier_options() == TierOptions(True, 4, "run.7", True, 8, None, 1 << 30)


def test_peer_partner_names_an_importable_partner_function() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_plus.integrations.torchtitan import use_dcp_plus
    from tests.dist._tier_job import mirrored

    cfg = use_dcp_plus(CheckpointManager.Config(enable=True, async_mode="async"),
                       memory_tier=True, peer_tier=True,
                       peer_partner="tests.dist._tier_job:mirrored")
    assert cfg.tier_options().partner is mirrored


@pytest.mark.parametrize(("bad", "message"), [
    ({"memory_tier": True, "durable_every": 0}, "checkpoint.durable_every must be an integer"),
    ({"durable_every": 3}, "checkpoint.durable_every=3 needs checkpoint.memory_tier=True"),
    ({"peer_tier": True}, "checkpoint.peer_tier=True needs memory_tier=True"),
    ({"memory_tier": True, "peer_tier": True, "ranks_per_node": 0},
     "checkpoint.ranks_per_node must be >= 1"),
    ({"memory_tier": True, "job_id": "../x"}, "checkpoint.job_id must be 1-64 characters"),
    ({"memory_tier": True, "memory_tier_bytes": 0}, "checkpoint.memory_tier_bytes must be"),
    ({"memory_tier": True, "async_executor": "process"},
     "checkpoint.memory_tier=True needs checkpoint.async_executor='thread'"),
    ({"memory_tier": True, "peer_partner": "tests.dist._tier_job:mirrored"},
     "checkpoint.peer_partner='tests.dist._tier_job:mirrored' needs checkpoint.peer_tier=True"),
    ({"memory_tier": True, "peer_tier": True, "peer_partner": "mirrored"},
     "checkpoint.peer_partner='mirrored' is not 'package.module:function'"),
    ({"memory_tier": True, "peer_tier": True, "peer_partner": "no_such_module_x:f"},
     "checkpoint.peer_partner='no_such_module_x:f' cannot be imported"),
    ({"memory_tier": True, "peer_tier": True, "peer_partner": "os:sep"},
     "checkpoint.peer_partner='os:sep' is a str, not a function"),
])
def test_bad_tier_settings_are_refused_naming_the_setting(bad: dict, message: str) -> None:
    from dcp_plus.integrations.torchtitan import DcpPlusCheckpointManager

    with pytest.raises(ValueError, match=re.escape(message)):
        DcpPlusCheckpointManager.Config(enable=True, **bad)
