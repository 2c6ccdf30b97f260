"""Recovery from the fastest tier: the ranks agree on the newest step every rank can restore,
each takes it from its own memory, its partner's replica or durable storage, and all check
that everyone succeeded (else the failed tier is struck off and they agree again)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from dcp_plus._compat.torch_dcp import set_element
from dcp_plus.errors import DcpPlusError
from dcp_plus.tiers.flat import Flat

log = logging.getLogger(__name__)
MEMORY, PEER, DURABLE = "memory", "peer", "durable"


@dataclass(frozen=True)
class Restore:
    """What ``load_latest`` did: the ``step`` restored, each rank's tier (``tiers[rank]`` is
    ``"memory"``, ``"peer"`` or ``"durable"``) and the wall time on this rank."""

    step: int
    tiers: list[str]
    seconds: float


@dataclass
class Offer:
    """What one rank can restore from: own snapshots and the replicas it holds (step ->
    fingerprint), its state's fingerprint, and the durable steps it sees."""

    own: dict[int, str]
    held: dict[int, str]
    fingerprint: str
    durable: list[int]
    failed: list[tuple[int, str]] = field(default_factory=list)
    """(step, tier) this rank tried and failed."""


def choose(offers: list[Offer], partners: list[int] | None,
           struck: set[tuple[int, int, str]]) -> tuple[int, list[str]] | None:
    """The newest step every rank can restore, and each rank's fastest tier for it; None
    when no step qualifies. ``struck``: (rank, step, tier) known to fail."""
    durable = {s for o in offers for s in o.durable}
    steps = durable | {s for o in offers for s in (*o.own, *o.held)}
    for step in sorted(steps, reverse=True):
        plan = []
        for r, o in enumerate(offers):
            options = []
            if o.own.get(step) == o.fingerprint:
                options.append(MEMORY)
            if partners is not None and offers[partners[r]].held.get(step) == o.fingerprint:
                options.append(PEER)
            if step in durable:
                options.append(DURABLE)
            options = [t for t in options if (r, step, t) not in struck]
            if not options:
                break
            plan.append(options[0])
        else:
            return step, plan
    return None


def put_values(state: dict[str, Any], flat: Flat, values: dict[str, Any]) -> None:
    """Set restored non-tensor values into ``state`` at their flat keys' paths."""
    for key, value in values.items():
        path = flat.mapping.get(key)
        if path is None:
            raise DcpPlusError(f"restored value {key!r} is not in the state dict")
        set_element(state, path, value)


@dataclass
class Attempt:
    """One rank's part of a restore: how to take ``step`` from each tier."""

    rank: int
    take: dict[str, Callable[[int], None]]
    """tier -> restore ``step`` from it into the state (raises on failure)."""
    serve: Callable[[int, list[str]], list[Any]]
    """Start the sends this rank owes for the plan (replicas it holds); returns waitables."""


def restore(offers_of: Callable[[Offer], list[Offer]], offer: Offer, attempt: Attempt,
            everyone: Callable[[bool], bool], partners: list[int] | None,
            clock: Callable[[], float] = time.perf_counter) -> Restore | None:
    """Agree and restore; None when no step can be restored by every rank."""
    t0 = clock()
    struck: set[tuple[int, int, str]] = set()
    for _ in range(3 * len(offer.durable) + 16):
        offers = offers_of(offer)
        for r, o in enumerate(offers):
            struck.update((r, s, t) for s, t in o.failed)
        chosen = choose(offers, partners, struck)
        if chosen is None:
            return None
        step, plan = chosen
        if all(t == DURABLE for t in plan):  # the caller's collective, verified load
            return Restore(step, plan, clock() - t0)
        mine = plan[attempt.rank]
        sends = attempt.serve(step, plan)
        ok = True
        try:
            attempt.take[mine](step)
        except (Exception, CheckpointException) as e:  # DCP raises a BaseException
            log.warning("rank %d: restoring step %d from %s failed: %s", attempt.rank, step,
                        mine, e)
            offer.failed.append((step, mine))
            ok = False
        finally:
            for w in sends:
                w.wait()
        if everyone(ok):
            return Restore(step, plan, clock() - t0)
        log.warning("step %d: not every rank restored it; agreeing again", step)
    return None
