"""Logging for the ``dcp-plus`` command: WARNING unless ``-v``, torch's chatter kept out,
and log lines written through tqdm so that progress bars on a terminal are not torn.

torch's PROCESS-executor daemon (``torch.distributed.checkpoint._async_process_executor``)
sets the root logger of its own process to INFO with a handler of its own and logs there
("Checkpoint background process is running...") onto the terminal it inherits. Our own child
processes (the demo's trainer, the bench's ranks) take the level from :data:`LEVEL_ENV`
(:func:`child_env`, :func:`configure_from_env`); the daemon gets it through
:func:`quiet_checkpoint_daemon`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

LEVEL_ENV = "DCP_PLUS_LOG_LEVEL"
FORMAT = "%(levelname)s %(name)s: %(message)s"
_level = logging.WARNING


class _RootBelow(logging.Filter):
    """Drops records logged on the root logger itself below a level (torch's DCP modules log
    with ``logging.getLogger()``); records of named loggers pass by their logger's level."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def _apply(level: int, *, handler: bool = True) -> None:
    global _level
    _level = level
    if handler:
        logging.basicConfig(level=level, format=FORMAT)
    root = logging.getLogger()
    root.setLevel(level)
    for f in [f for f in root.filters if isinstance(f, _RootBelow)]:
        root.removeFilter(f)
    root.addFilter(_RootBelow(level))
    # a process whose root another library set to INFO keeps ours at the chosen level
    logging.getLogger("dcp_plus").setLevel(level)


def configure(verbose: bool) -> int:
    """Set up logging for this CLI process (INFO with ``-v``, else WARNING); the level."""
    level = logging.INFO if verbose else logging.WARNING
    _apply(level)
    return level


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) plus this process's CLI log level."""
    out = dict(os.environ if env is None else env)
    out[LEVEL_ENV] = logging.getLevelName(_level)
    return out


def configure_from_env() -> None:
    """In one of our child processes: the level its CLI parent chose (WARNING if none)."""
    level = logging.getLevelName(os.environ.get(LEVEL_ENV, "WARNING"))
    _apply(level if isinstance(level, int) else logging.WARNING)


def bars_safe() -> contextlib.AbstractContextManager[Any]:
    """While active, log records go through ``tqdm.write`` (when stderr is a terminal, the
    only place bars are drawn): a line is printed above the bar instead of through it."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def _daemon_main(level: int, *args: Any) -> Any:
    """The PROCESS-executor daemon's entry point, run in that process: our level first."""
    from dcp_plus._compat.torch_dcp import process_daemon_class

    cls = process_daemon_class()
    assert cls is not None, "the daemon runs only where quiet_checkpoint_daemon found it"
    _apply(level, handler=False)  # the daemon adds its own handler
    return cls._checkpointing_subprocess(*args)


@contextlib.contextmanager
def quiet_checkpoint_daemon() -> Iterator[None]:
    """A PROCESS-executor daemon started inside this block logs at this process's level.

    The daemon is spawned with ``_AsyncCheckpointProcess._checkpointing_subprocess`` as its
    target; inside the block that target is :func:`_daemon_main` bound to our level (a
    module function, so it pickles by name into the spawned process). A torch without that
    private entry point is left alone."""
    from dcp_plus._compat.torch_dcp import process_daemon_class

    cls = process_daemon_class()
    if cls is None:
        yield
        return
    original = cls.__dict__["_checkpointing_subprocess"]
    cls._checkpointing_subprocess = functools.partial(_daemon_main, _level)
    try:
        yield
    finally:
        cls._checkpointing_subprocess = original
