"""The copy engine: moves live tensor bytes into arena views off the trainer's thread.

* CPU sources: large contiguous tensors are cut into chunks, and the list of copies is split
  into ``num_threads`` contiguous byte ranges; the driver thread copies one range and a small
  persistent pool the others (``copy_`` releases the GIL).
* CUDA sources: one side stream per device first waits on an event recorded on the caller's
  current stream inside ``stage()``, then issues non-blocking device-to-host copies into the
  page-locked slabs; completion is an event on the side stream. In GPU mode
  (:mod:`~dcp_plus.stagers.device_copy`) the side stream copies into a device mirror first,
  the live tensors are released when that copy is done, and the mirror goes to host after.

Jobs run strictly in submission order on one driver thread, so snapshot N is complete before
snapshot N+1 starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from dcp_plus.stagers.device_copy import Mirror, MirrorPlan, flat_bytes
from dcp_plus.stagers.hashed_copy import Key, copy_hashed, digests, pieces_of, split_pieces

logger = logging.getLogger(__name__)
T = TypeVar("T")

FOREACH_MAX_BYTES = 1 << 20
"""Larger same-device copies go to ``copy_`` (a ``cudaMemcpyAsync`` at copy-engine speed)
rather than to ``_foreach_copy_``'s byte kernel."""

CHUNK_BYTES = 16 << 20
"""Largest single ``copy_`` on the CPU path; bounds the imbalance between threads."""


Lane = tuple[list[torch.Tensor], list[torch.Tensor]]
"""One thread's share of a copy: ``(sources, destinations)``, index-aligned."""


def split_lanes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], lanes: int) -> list[Lane]:
    """Split ``pairs`` into ``lanes`` runs of about equal bytes, order kept.

    A contiguous tensor larger than :data:`CHUNK_BYTES` is cut into chunks so one huge tensor
    can be shared between lanes. Kept cheap (one ``nbytes`` per tensor): it runs on the driver
    thread while the trainer may want the GIL back.
    """
    sizes = [s.nbytes for s, _ in pairs]
    total = sum(sizes) or 1
    out: list[Lane] = [([], []) for _ in range(lanes)]
    done = 0
    for (src, dst), nbytes in zip(pairs, sizes, strict=True):
        if nbytes > CHUNK_BYTES and lanes > 1 and src.is_contiguous():
            s, d = src.reshape(-1), dst.reshape(-1)
            step = max(1, CHUNK_BYTES // src.element_size())
            for i in range(0, s.numel(), step):
                lane = out[min(lanes - 1, done * lanes // total)]
                lane[0].append(s[i : i + step])
                lane[1].append(d[i : i + step])
                done += min(step, s.numel() - i) * src.element_size()
            continue
        lane = out[min(lanes - 1, done * lanes // total)]
        lane[0].append(src)
        lane[1].append(dst)
        done += nbytes
    return out


def copy_bytes(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, non_blocking: bool = False
) -> None:
    """Copy every ``(src, dst)`` pair: small contiguous pairs on one device as raw bytes in
    one foreach call (any dtype, fp8 included, one C++ loop instead of a Python one); large
    ones, pairs across devices and strided ones by ``copy_`` each (a plain memcpy where it
    can be one)."""
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    with torch.no_grad():
        for s, d in pairs:
            if s.device != d.device or s.nbytes >= FOREACH_MAX_BYTES:
                d.copy_(s, non_blocking=non_blocking)
                continue
            sb, db = flat_bytes(s), flat_bytes(d)
            if sb is None or db is None:
                d.copy_(s, non_blocking=non_blocking)
            elif sb.numel():
                srcs.append(sb)
                dsts.append(db)
        if srcs:
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def _copy_run(run: Lane) -> None:
    # One foreach call per lane: the copies run in C++ with the GIL released throughout, so the
    # trainer thread returning from async_save never queues behind a Python copy loop.
    srcs, dsts = run
    if srcs:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)


class CopyEngine:
    """A driver thread plus ``num_threads - 1`` copy workers, and CUDA side streams.

    Args:
        num_threads: CPU threads that copy (the driver counts as one).
    """

    def __init__(self, num_threads: int = 2) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self._driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpp-stage")
        self._pool = (
            ThreadPoolExecutor(max_workers=num_threads - 1, thread_name_prefix="dcpp-copy")
            if num_threads > 1
            else None
        )
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    # -- trainer thread -------------------------------------------------------------------

    def mark(self, devices: set[torch.device]) -> dict[int, Any]:
        """Record an event on the caller's current stream of every CUDA device in ``devices``.

        Call from the thread that produced the tensors (inside ``stage()``); also creates the
        side streams there, so they never alias the compute stream.
        """
        events: dict[int, Any] = {}
        for dev in devices:
            if dev.type != "cuda":
                continue
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            with self._lock:
                if idx not in self._streams:
                    self._streams[idx] = torch.cuda.Stream(device=idx)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(idx))
            events[idx] = ev
        return events

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run ``fn`` on the driver thread after every earlier job."""
        return self._driver.submit(fn)

    # -- driver thread --------------------------------------------------------------------

    def copy(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        events: dict[int, Any] | None = None,
        *,
        hashed: bool = False,
    ) -> dict[Key, str]:
        """Copy every ``src`` into its ``dst``; returns when all bytes have landed. With
        ``hashed``, returns the checksum (:mod:`~dcp_plus.format.piece_digest`) of every
        destination a CPU byte copy filled, taken in the same pass as the copy."""
        cpu = [(s, d) for s, d in pairs if s.device.type == "cpu"]
        gpu = [(s, d) for s, d in pairs if s.device.type == "cuda"]
        done_events: list[Any] = []
        sums: dict[Key, str] = {}
        try:
            if gpu:
                done_events = self._issue_cuda(gpu, events or {})
            if cpu:
                sums = self._copy_cpu(cpu, hashed)
        finally:  # also on error: no queued copy may still write a buffer the caller frees
            for ev in done_events:
                ev.synchronize()
        other = len(pairs) - len(cpu) - len(gpu)
        if other:
            for s, d in pairs:
                if s.device.type not in ("cpu", "cuda"):
                    d.copy_(s)
        return sums

    def _copy_cpu(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], hashed: bool
    ) -> dict[Key, str]:
        if not hashed:
            self._in_lanes(_copy_run, split_lanes(pairs, self.num_threads))
            return {}
        pieces, rest = pieces_of(pairs)
        if rest:
            copy_bytes(rest)
        return digests(self._in_lanes(copy_hashed, split_pieces(pieces, self.num_threads)))

    def _in_lanes(self, run: Callable[[Any], T], lanes: Sequence[Any]) -> list[T]:
        """``run(lane)`` for every lane: the first on this thread, the others on the pool."""
        busy = [lane for lane in lanes[1:] if (lane[0] if isinstance(lane, tuple) else lane)]
        futures = [self._pool.submit(run, lane) for lane in busy] if self._pool else []
        results: list[T] = []
        err: BaseException | None = None
        try:
            results.append(run(lanes[0]))
        except BaseException as e:
            err = e
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:
                err = err or e
        if err is not None:
            raise err
        return results

    def _issue_cuda(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], events: dict[int, Any]
    ) -> list[Any]:
        by_dev: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for s, d in pairs:
            by_dev.setdefault(s.device.index or 0, []).append((s, d))
        done = []
        for idx, items in by_dev.items():
            stream = self._streams[idx]
            with torch.cuda.stream(stream):
                if idx in events:
                    stream.wait_event(events[idx])
                copy_bytes(items, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            done.append(ev)
        return done

    def copy_through_mirror(
        self,
        mirror: Mirror,
        to_mirror: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cpu: Sequence[tuple[torch.Tensor, torch.Tensor]],
        to_host: Sequence[tuple[torch.Tensor, torch.Tensor]],
        events: dict[int, Any],
        released: Callable[[float], None],
    ) -> None:
        """GPU-mode snapshot: copy ``to_mirror`` (live CUDA tensor, mirror view) pairs and the
        ``cpu`` pairs, call ``released(device_copy_s)`` once no live tensor is read any more,
        then return when the ``to_host`` (mirror bytes, slab bytes) copies have landed. Every
        pair is ``(source, destination)``.

        Everything runs on the device's side stream, after the work the caller queued before
        ``stage()``; the device -> host copies are queued right behind the device copy.
        """
        stream = self._streams[mirror.device]
        try:
            with torch.cuda.stream(stream):
                if mirror.device in events:
                    stream.wait_event(events[mirror.device])
                start = torch.cuda.Event(enable_timing=True, blocking=True)
                start.record(stream)
                copy_bytes(to_mirror)
                on_device = torch.cuda.Event(enable_timing=True, blocking=True)
                on_device.record(stream)
                copy_bytes(to_host, non_blocking=True)
                on_host = torch.cuda.Event(blocking=True)  # waits without spinning a core
                on_host.record(stream)
            if cpu:
                self._copy_cpu(cpu, hashed=False)
            on_device.synchronize()
            released(start.elapsed_time(on_device) / 1e3)
            on_host.synchronize()
        except BaseException:
            try:
                stream.synchronize()  # no copy may still write a buffer the caller frees
            except Exception as e:  # a sticky CUDA error: keep the first one
                logger.warning("ArenaStager: side stream not drained after a failure: %s", e)
            raise

    def allocate_mirror(
        self, plan: MirrorPlan, device: int, extents: Sequence[Any], on_device: Sequence[bool]
    ) -> Mirror:
        """A :class:`Mirror` allocated and zero-filled on this thread's stream (the block then
        returns to that stream's pool when freed: the side stream's pool would keep it from
        training), with the side stream ordered after the fill."""
        mirror = Mirror(plan, device, extents, on_device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        mirror.used_on(stream)
        return mirror

    def streams(self) -> dict[int, Any]:
        """The CUDA side streams, by device index (tests and diagnostics)."""
        return dict(self._streams)

    def close(self) -> None:
        """Finish queued jobs and join every thread."""
        self._driver.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for stream in self._streams.values():
            stream.synchronize()
        self._streams.clear()
