"""``Tiers``: what a ``CheckpointManager`` with a memory (and peer) tier does per save and on
restore, over :class:`~dcp_plus.tiers.memory.MemoryTier` and
:class:`~dcp_plus.tiers.peer.PeerTier`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from dcp_plus.errors import CapacityError
from dcp_plus.memory.slabs import SHM_DIR
from dcp_plus.tiers import names
from dcp_plus.tiers.flat import flatten, plain
from dcp_plus.tiers.memory import MemoryTier, restore_own
from dcp_plus.tiers.options import TierOptions, tier_copies, tier_memory_bytes
from dcp_plus.tiers.peer import PeerTier, default_partner
from dcp_plus.tiers.recovery import DURABLE, MEMORY, PEER, Attempt, Offer, Restore, put_values
from dcp_plus.tiers.recovery import restore as agree_and_restore

log = logging.getLogger(__name__)


def available_bytes() -> int:
    """Room for new snapshots: free space in ``/dev/shm``, and at most ``MemAvailable``."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = min(free, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return free


class Tiers:
    """The memory and peer tiers of one rank of one job."""

    def __init__(self, options: TierOptions, root: str, rank: int, world_size: int,
                 ranks: list[int] | None) -> None:
        self.options = options
        self.job = names.check_job_id(options.job_id or names.job_id_for(root))
        self.rank, self.world_size = rank, world_size
        self.memory = MemoryTier(self.job, rank, world_size)
        self.peer: PeerTier | None = None
        if options.peer_tier:
            if world_size < 2:
                raise ValueError("peer_tier=True needs at least 2 ranks")
            partner = options.partner or default_partner(world_size, options.per_node())
            group = dist.new_group(ranks=ranks, backend="gloo")
            self.peer = PeerTier(self.job, rank, world_size, group, partner)
        self._saves = 0
        self._held: Future[None] | None = None  # releases the newest snapshot's buffer
        self._held_dict: Mapping[str, Any] | None = None  # whose death would release it too
        self.remove_stale()
        if options.state_bytes is not None:
            self.check_room(options.state_bytes)

    # -- saving ---------------------------------------------------------------------------

    def next_is_durable(self) -> bool:
        """Counts a save; whether it is also persisted (the 1st, (N+1)-th, ...)."""
        durable = self._saves % self.options.durable_every == 0
        self._saves += 1
        return durable

    def check_room(self, state_bytes: int) -> None:
        """Raise ``CapacityError`` unless shared memory has room for this rank's snapshots."""
        need = tier_memory_bytes(state_bytes, self.peer is not None)
        held = sum(os.stat(f.path).st_blocks * 512 for f in names.listing(self.job, self.rank)
                   if f.kind != "link")  # links share the stager's memory, counted below
        have = available_bytes() + held + 2 * state_bytes  # the stager's buffers exist anyway
        if need > have:
            raise CapacityError(
                f"memory tier of job {self.job}, rank {self.rank}: snapshots of "
                f"{state_bytes} bytes need {need} bytes of shared memory at the peak "
                f"({tier_copies(self.peer is not None)} x the state), but {SHM_DIR} and MemAvailable "
                f"leave {have}; enlarge {SHM_DIR}, free memory, or turn the tier off")

    def capture(self, step: int, staged: Mapping[str, Any], release: Future[None]) -> None:
        """Keep the staged snapshot of ``step`` (record written last), replicate it, and
        release the previous snapshot's buffer. ``release`` frees this one's buffer later."""
        record, error = None, None
        try:
            record = self.memory.take(step, staged)
        except Exception as e:  # still take part in the exchange, or the partner would hang
            error = e
        if self.peer is not None:
            self.peer.exchange(record, step)
        if error is not None:
            raise error
        previous, self._held, self._held_dict = self._held, release, staged
        if previous is not None:
            previous.set_result(None)

    def let_go(self, release: Future[None]) -> None:
        """A snapshot the tier does not keep (its capture failed): free its buffer."""
        if release is not self._held and not release.done():
            release.set_result(None)

    # -- restoring ------------------------------------------------------------------------

    def holds_snapshots(self) -> bool:
        """Whether this rank holds a complete snapshot of this world size: its own, or a
        replica of its source's. Reads the records only (the state is not asked for)."""
        return bool(self.memory.records()) or (self.peer is not None and bool(self.peer.held()))

    def restore(self, state: dict[str, Any], durable: list[int],
                load_durable: Callable[[int, dict[str, Any]], None],
                gather: Callable[[Offer], list[Offer]], everyone: Callable[[bool], bool],
                ) -> Restore | None:
        """Restore ``state`` in place from the fastest tier; None when no step qualifies.
        An all-durable choice is not executed here: its ``tiers`` are all ``"durable"`` and
        the caller loads it the usual way (collective, verified)."""
        plain_state = plain(state)
        flat = flatten(plain_state)
        own = {r.step: r for r in self.memory.records()}
        held = {r.step: r for r in self.peer.held()} if self.peer is not None else {}
        offer = Offer({s: r.fingerprint for s, r in own.items()},
                      {s: r.fingerprint for s, r in held.items()}, flat.fingerprint, durable)
        partners = self.peer.partners if self.peer is not None else None

        def take_memory(step: int) -> None:
            put_values(plain_state, flat, restore_own(own[step], flat))

        def take_peer(step: int) -> None:
            assert self.peer is not None
            rec, values = self.peer.fetch(flat)
            if rec.step != step:
                raise ValueError(f"partner sent step {rec.step}, not {step}")
            put_values(plain_state, flat, values)

        def take_durable(step: int) -> None:
            load_durable(step, plain_state)

        def serve(step: int, plan: list[str]) -> list[Any]:
            if self.peer is None or plan[self.peer.source] != PEER:
                return []
            return self.peer.serve(held[step], self.peer.source,
                                   after_fetch=plan[self.rank] == PEER)

        attempt = Attempt(self.rank, {MEMORY: take_memory, PEER: take_peer,
                                      DURABLE: take_durable}, serve)
        done = agree_and_restore(gather, offer, attempt, everyone, partners)
        if done is not None and not all(t == DURABLE for t in done.tiers):
            for k, v in state.items():
                if isinstance(v, Stateful):
                    v.load_state_dict(plain_state[k])
                else:
                    state[k] = plain_state[k]  # a top-level value was set in the copy
        return done

    # -- cleaning up ----------------------------------------------------------------------

    def remove_stale(self) -> None:
        """Remove this rank's files that its newest complete snapshot (of this world size)
        and its newest replica do not use: older steps, other world sizes, torn ones."""
        keep: set[str] = set()
        newest = [*self.memory.records()[:1], *(self.peer.held()[:1] if self.peer else [])]
        for r in newest:
            keep.add(names.record_name(self.job, self.rank, r.owner, r.step))
            keep.update(e.file for e in r.entries)
        for f in names.listing(self.job, self.rank):
            if f.name not in keep:
                names.unlink(f.name)

    def close(self, remove: bool) -> None:
        """Free the held buffer and the spare replica files; with ``remove``, also every
        snapshot of this rank."""
        if self._held is not None and not self._held.done():
            self._held.set_result(None)
        self._held_dict = None
        if remove:
            self.memory.remove_all()
            if self.peer is not None:
                self.peer.remove_all()
        else:  # keep the newest snapshot and replica: no spare file, no older step
            self.remove_stale()
        if self.peer is not None:
            self.peer.unmap()

