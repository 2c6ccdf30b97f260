"""Errors a TorchTitan user meets, said in TorchTitan's terms (its settings, its flags)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dcp_plus.errors import StockCheckpointError
from dcp_plus.manager.handle import wrapped_errors

ALLOW_PICKLE_OVERRIDE = (
    "--override.imports 'dcp_plus.integrations.torchtitan.use_dcp_plus="
    '{"allow_pickle_on_load": true}\'')
"""The command-line form of ``checkpoint.allow_pickle_on_load`` that TorchTitan accepts (its
own ``--checkpoint.*`` flags are parsed before the override adds the field)."""


STOCK_RECORD = "was written by stock DCP: its .metadata is a pickle"
"""The start of the readers' :class:`StockCheckpointError`; a torch release that hands DCP's
caller only a reader error's message (``AssertionError: metadata is None; ...``) keeps it."""


def _unsafe(exc: BaseException) -> BaseException | None:
    """The reader's :class:`StockCheckpointError` behind ``exc`` (DCP wraps reader errors per
    rank), or ``None``; other refusals (an unsafe value in a dcp_plus checkpoint) are not it."""
    return next((e for e in wrapped_errors(exc)
                 if isinstance(e, StockCheckpointError) or STOCK_RECORD in str(e)), None)


@contextmanager
def stock_checkpoint_hint(checkpoint_id: str) -> Iterator[None]:
    """Turn "this checkpoint is a stock DCP one" into the TorchTitan setting that loads it."""
    try:
        yield
    except BaseException as e:
        if _unsafe(e) is None:
            raise
        raise StockCheckpointError(
            f"{checkpoint_id} was written by stock DCP (TorchTitan without dcp_plus): its "
            ".metadata is a pickle, and unpickling can run arbitrary code, so dcp_plus does "
            "not load it by default. Only if you trust it, set checkpoint.allow_pickle_on_load:"
            f" on the command line {ALLOW_PICKLE_OVERRIDE}, or in a recipe "
            "with_dcp_plus(config, allow_pickle_on_load=True). Checkpoints saved from then on "
            "are dcp_plus ones") from e
