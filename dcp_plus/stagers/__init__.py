"""Stagers: snapshot a state dict into reusable shared-memory arenas for ``dcp.async_save``."""

from dcp_plus.stagers.arena_stager import ArenaStager
from dcp_plus.stagers.guard import GuardHandle

__all__ = ["ArenaStager", "GuardHandle"]
