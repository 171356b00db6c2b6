"""An importance-aware paged memory pool for packed records.

With dynamic bit-widths every training step saves records of different sizes. Allocating each one
from the general allocator fragments memory and, on CPU, pays a page fault for every fresh buffer.
``PagePool`` instead keeps a few large preallocated regions ("chunks"), carves them into fixed-size
pages and stores each record's payload in a *list* of pages, so no record ever needs a contiguous
free run and the same pages are reused step after step::

    pool = PagePool(PoolConfig(budget_bytes=512 * 2**20))
    rec = pool.store((lo, scale, codes), importance=0.7)    # copies the bytes into pages
    lo, scale, codes = rec.load()                            # bit-exact copies, pages stay put
    with rec.borrow() as (lo, scale, codes):                 # or: zero-copy views for one block
        ...
    rec.release()                                            # pages go back to the free list
    pool.end_step()                                          # step boundary: adapt, maybe shrink

When a store would exceed the byte budget the least important records are first *demoted*
(re-encoded at fewer bits by a callback given at store time) and then *spilled* to files, and paged
back in on ``load()`` / ``prefetch()``. Nothing is ever dropped: ``load()`` returns the stored bytes
(or, after a demotion, the demoted payload) or raises ``PoolError``.
"""

from __future__ import annotations

import contextlib
import enum
import math
import mmap
import numbers
import os
import shutil
import struct
import tempfile
import threading
import uuid
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from sortedcontainers import SortedList

from ..errors import ArgumentTypeError, DaftrainError, InvalidArgumentError

__all__ = [
    "AdaptiveStep",
    "Demand",
    "FixedStep",
    "PagePool",
    "PoolBudgetError",
    "PoolConfig",
    "PoolError",
    "PoolStats",
    "PooledRecord",
    "RecordState",
    "StepPolicy",
    "TrackingStep",
]

KIB = 1 << 10
MIB = 1 << 20

_PART_ALIGN = 16
"""Each payload tensor starts at a multiple of this in a record's byte stream, so that ``load`` can
view one gathered buffer as float32 / bfloat16 / ... tensors (views need aligned offsets)."""

_MAX_SCRATCH = 1
"""Scratch buffers a pool keeps for ``borrow`` (see NOTE [ Scratch buffers ])."""

_SPILL_MAGIC = b"DAFTPOOL"
_SPILL_HEADER = struct.Struct("<8sQQ")  # magic, record sequence number, stream bytes
_SPILL_TRAILER = struct.Struct("<I")  # CRC32 of the stream

Payload = tuple[torch.Tensor, ...]
DemoteFn = Callable[[Payload], "Sequence[torch.Tensor] | None"]


class PoolError(DaftrainError, RuntimeError):
    """The pool cannot do what was asked (closed pool, released record, corrupted spill file, ...)."""


class PoolBudgetError(PoolError):
    """A store cannot fit in the byte budget and nothing less important can be demoted or spilled."""

    def __init__(self, requested_bytes: int, budget_bytes: int, used_bytes: int, detail: str = "") -> None:
        self.requested_bytes, self.budget_bytes, self.used_bytes = requested_bytes, budget_bytes, used_bytes
        msg = (
            f"cannot store a record of {requested_bytes} bytes: the budget allows {budget_bytes} bytes "
            f"and {used_bytes} bytes are in use"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


# ---------------------------------------------------------------------------------------------------
# Step policies
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Demand:
    """What the pool has observed of per-step peak usage (bytes); updated at each ``end_step``."""

    steps: int = 0
    last_peak: int = 0
    mean: float = 0.0
    dev: float = 0.0


@runtime_checkable
class StepPolicy(Protocol):
    """How the pool grows and shrinks. Implementations are frozen: the pool keeps the ``Demand``."""

    def observe(self, demand: Demand, step_peak_bytes: int) -> Demand:
        """The demand estimate after a step whose peak usage was ``step_peak_bytes``."""
        ...

    def plan_growth(self, shortfall_bytes: int, reserved_bytes: int, demand: Demand) -> list[int]:
        """Sizes of the chunks to allocate when a store is ``shortfall_bytes`` short (sum >= it)."""
        ...

    def keep_bytes(self, demand: Demand) -> int:
        """At a step boundary, how much reservation to keep."""
        ...

    def slack_bytes(self, keep_bytes: int) -> int:
        """Hysteresis: the pool shrinks only when it reserves more than ``keep + slack``."""
        ...


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_fraction(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
        raise InvalidArgumentError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class FixedStep:
    """Grow and shrink in fixed steps of ``step_bytes`` (DAF uses 100 MB).

    Growth allocates as many ``step_bytes`` chunks as the shortfall needs; at a step boundary the
    trailing entirely free chunks are freed as long as what remains holds the last step's peak.
    """

    step_bytes: int = 100 * MIB

    def __post_init__(self) -> None:
        _check_int("FixedStep.step_bytes", self.step_bytes, 1)

    def observe(self, demand: Demand, step_peak_bytes: int) -> Demand:
        return Demand(demand.steps + 1, step_peak_bytes, float(step_peak_bytes), 0.0)

    def plan_growth(self, shortfall_bytes: int, reserved_bytes: int, demand: Demand) -> list[int]:
        return [self.step_bytes] * max(1, -(-shortfall_bytes // self.step_bytes))

    def keep_bytes(self, demand: Demand) -> int:
        return demand.last_peak

    def slack_bytes(self, keep_bytes: int) -> int:
        return 0


def _observe_peak(demand: Demand, step_peak_bytes: int, gain: float, dev_gain: float) -> Demand:
    """The EMA update of NOTE [ Adaptive step rule ] (shared by ``AdaptiveStep`` and ``TrackingStep``)."""
    p = float(step_peak_bytes)
    if demand.steps == 0:
        return Demand(1, step_peak_bytes, p, p / 8)
    dev = (1 - dev_gain) * demand.dev + dev_gain * abs(p - demand.mean)
    mean = (1 - gain) * demand.mean + gain * p
    return Demand(demand.steps + 1, step_peak_bytes, mean, dev)


# NOTE [ Adaptive step rule ]
# The adaptive policy sizes the pool from the observed per-step peak usage ``p`` (bytes of pages in
# use at the busiest moment of a step), with the estimator TCP uses for its retransmission timeout
# (RFC 6298): an exponential moving average of the peak and one of its absolute deviation,
#     dev  <- (1 - beta) * dev + beta * |p - mean|        (beta = dev_gain, 1/4)
#     mean <- (1 - alpha) * mean + alpha * p               (alpha = gain, 1/8)
# seeded with mean = p, dev = p / 8 after the first step. The *target* reservation is
#     target = mean + deviations * dev                     (deviations = 2)
# rounded up to whole pages (and capped by the budget). So the headroom is not a fixed percentage: it
# is what the step-to-step variation of the workload needs, and it tends to 0 on a steady workload.
# The gains set how fast the target follows a drift (about 1 / gain steps) against how much one
# unusually large or small step moves it. ``deviations`` trades memory for growth events: a step that
# peaks above the reservation grows it mid-step (a small chunk, faulted in once), so a lower value
# holds less idle memory and allocates more often (``bench_pool_step_policy.py`` shows the curve).
#   1. Mid-step growth (a store finds too few free pages) allocates max(shortfall, target - reserved,
#      min_step_bytes, g) bytes, where g is ``growth * reserved`` before any step was observed
#      (geometric growth: O(log) grow events in the first step) and ``deviations * dev`` after.
#   2. That amount is split into chunks of at most max(min_step_bytes, granule * target) bytes
#      (granule = 1/8), so the reservation can later be given back in steps of ~1/8 of the target:
#      chunks cannot be freed in part. Smaller chunks follow demand more closely but more records
#      straddle two chunks (two runs of pages: ``borrow`` must gather them); 1/8 measured ~4 % of
#      records straddling on the benchmark workload, against 13 % at 1/16.
#   3. At ``end_step``, only if the reservation exceeds target + slack with
#      slack = max(min_step_bytes, slack * target) (hysteresis: a busy step's growth is not given back
#      at once, or a workload that fluctuates around the target would allocate and free every few
#      steps), trailing chunks that are entirely free are freed while what remains is >= target.
#      Allocation takes pages from the lowest chunks first, so at a step boundary (everything
#      released) all trailing chunks are free.


@dataclass(frozen=True)
class AdaptiveStep:
    """Size the pool from an EMA of per-step peak usage plus a deviation-based headroom.

    See NOTE [ Adaptive step rule ] in ``pool.py``.
    """

    gain: float = 1 / 8
    dev_gain: float = 1 / 4
    deviations: float = 2.0
    growth: float = 0.5
    granule: float = 1 / 8
    slack: float = 1 / 16
    min_step_bytes: int = 1 * MIB

    def __post_init__(self) -> None:
        _check_fraction("AdaptiveStep.gain", self.gain, 1e-6, 1.0)
        _check_fraction("AdaptiveStep.dev_gain", self.dev_gain, 1e-6, 1.0)
        _check_fraction("AdaptiveStep.deviations", self.deviations, 0.0, 100.0)
        _check_fraction("AdaptiveStep.growth", self.growth, 0.0, 100.0)
        _check_fraction("AdaptiveStep.granule", self.granule, 1e-3, 1.0)
        _check_fraction("AdaptiveStep.slack", self.slack, 0.0, 100.0)
        _check_int("AdaptiveStep.min_step_bytes", self.min_step_bytes, 1)

    def observe(self, demand: Demand, step_peak_bytes: int) -> Demand:
        return _observe_peak(demand, step_peak_bytes, self.gain, self.dev_gain)

    def target_bytes(self, demand: Demand) -> int:
        return math.ceil(demand.mean + self.deviations * demand.dev)

    def plan_growth(self, shortfall_bytes: int, reserved_bytes: int, demand: Demand) -> list[int]:
        target = self.target_bytes(demand)
        extra = self.growth * reserved_bytes if demand.steps == 0 else self.deviations * demand.dev
        amount = math.ceil(max(shortfall_bytes, target - reserved_bytes, self.min_step_bytes, extra))
        cap = max(self.min_step_bytes, self.granule * max(target, reserved_bytes + amount))
        n = math.ceil(amount / cap)
        return [math.ceil(amount / n)] * n

    def keep_bytes(self, demand: Demand) -> int:
        return self.target_bytes(demand)

    def slack_bytes(self, keep_bytes: int) -> int:
        return math.ceil(max(self.min_step_bytes, self.slack * keep_bytes))


# NOTE [ Tracking step rule ]
# ``AdaptiveStep`` keeps mean + 2 * dev reserved between steps, so that a busy step seldom allocates;
# the price is idle memory at an ordinary step's peak (about 2 * dev of it, ~30 % of the reservation
# on a workload whose per-step total varies by ~18 %). ``TrackingStep`` makes the opposite trade: the
# reservation follows the peak of the *current* step, and what a busy step added is given back at
# its end. With ``mean`` and ``dev`` the estimator of NOTE [ Adaptive step rule ]:
#   1. Between steps it keeps the floor max(0, mean - deviations * dev) (deviations = 1), a level
#      most steps exceed, and no hysteresis slack: every ``end_step`` frees the trailing chunks
#      above the floor.
#   2. A store that finds too few free pages grows by max(shortfall, granule) bytes, where
#      granule = max(min_step_bytes, granule * mean) (1/32 of the mean, at least 256 KiB), in one
#      chunk, plus granule-sized chunks up to the floor if the pool is below it (demand rose).
#      So at the step's peak fewer than one granule of pages (plus a chunk's worth of floor above a
#      step that peaks below it) is free: occupancy ~ 1 - granule / (2 * peak).
#   3. Before any step was observed it grows geometrically (``growth * reserved``), in chunks of at
#      most max(min_step_bytes, granule * reserved): small chunks, because only whole trailing
#      chunks are ever freed, and the first step's chunks stay at the bottom of the pool for good.
# The cost is memory traffic to the OS: each step maps (faults in) and at its end unmaps about
# E[(peak - floor)+] bytes in (peak - floor) / granule grow events, and with chunks of ~1/32 of the
# demand more records straddle two chunks (``borrow`` gathers those into its scratch buffer). On the
# drifting workload of ``bench_pool_fragmentation.py`` (24 records a step, per-step total varying by
# ~18 %) that is ~6 MB mapped and ~3 grow + 3 shrink events a step, ~9 of 24 records straddling
# (~1 with ``AdaptiveStep``) and ~60 % more CPU time per step, for ~96 % mean occupancy at the step
# peaks (~75 % with ``AdaptiveStep``). ``deviations`` moves along that curve: 2 maps ~11 MB a step
# for ~98 %. Use it where idle reserved memory costs more than that, e.g. when other allocations
# share the host's memory; with many records per step (a real network) the straddling share drops.


@dataclass(frozen=True)
class TrackingStep:
    """Keep a floor below the typical per-step peak and grow to each step's peak in small granules.

    See NOTE [ Tracking step rule ] in ``pool.py``. Trades grow / shrink events (and the page faults
    of re-mapping up to the peak every step) for ~96 % occupancy (pages in use / reserved) at each
    step's peak, where ``AdaptiveStep`` idles its headroom.
    """

    gain: float = 1 / 8
    dev_gain: float = 1 / 4
    deviations: float = 1.0
    """The floor kept between steps is ``mean - deviations * dev`` (higher: fewer faults per step,
    more idle memory at steps that peak below it)."""
    granule: float = 1 / 32
    """Mid-step growth granule, as a fraction of the mean peak."""
    growth: float = 0.5
    min_step_bytes: int = 256 * KIB

    def __post_init__(self) -> None:
        _check_fraction("TrackingStep.gain", self.gain, 1e-6, 1.0)
        _check_fraction("TrackingStep.dev_gain", self.dev_gain, 1e-6, 1.0)
        _check_fraction("TrackingStep.deviations", self.deviations, 0.0, 100.0)
        _check_fraction("TrackingStep.granule", self.granule, 1e-4, 1.0)
        _check_fraction("TrackingStep.growth", self.growth, 0.0, 100.0)
        _check_int("TrackingStep.min_step_bytes", self.min_step_bytes, 1)

    def observe(self, demand: Demand, step_peak_bytes: int) -> Demand:
        return _observe_peak(demand, step_peak_bytes, self.gain, self.dev_gain)

    def granule_bytes(self, demand: Demand) -> int:
        return math.ceil(max(self.min_step_bytes, self.granule * demand.mean))

    def plan_growth(self, shortfall_bytes: int, reserved_bytes: int, demand: Demand) -> list[int]:
        if demand.steps == 0:  # rule 3
            amount = math.ceil(max(shortfall_bytes, self.min_step_bytes, self.growth * reserved_bytes))
            cap = math.ceil(max(self.min_step_bytes, self.granule * (reserved_bytes + amount)))
            n = math.ceil(amount / cap)
            return [math.ceil(amount / n)] * n
        granule = self.granule_bytes(demand)
        first = max(shortfall_bytes, granule)  # rule 2
        below_floor = self.keep_bytes(demand) - reserved_bytes - first
        return [first] + [granule] * max(0, math.ceil(below_floor / granule))

    def keep_bytes(self, demand: Demand) -> int:
        return max(0, math.floor(demand.mean - self.deviations * demand.dev))

    def slack_bytes(self, keep_bytes: int) -> int:
        return 0


# ---------------------------------------------------------------------------------------------------
# Configuration and statistics
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolConfig:
    """How a ``PagePool`` reserves, budgets and spills memory.

    Example::

        PoolConfig(page_size=64 * 2**10, budget_bytes=2 * 2**30, step=FixedStep(100 * 2**20))
    """

    page_size: int = 64 * KIB
    """Bytes per page: a power of two >= 4 KiB. A record wastes on average half a page."""

    initial_bytes: int = 0
    """Bytes reserved (allocated and touched) up front, rounded up to pages; 0 reserves lazily."""

    budget_bytes: int | None = None
    """Most bytes of pages the pool may hold in use *and* reserve; ``None`` is unlimited. Whole pages
    count, so the effective budget is ``budget_bytes // page_size`` pages. ``set_budget`` changes it
    (after lowering it, chunks still in use stay reserved until they are entirely free)."""

    step: StepPolicy = field(default_factory=AdaptiveStep)
    """How the pool grows and shrinks: ``FixedStep(...)``, ``AdaptiveStep(...)`` (the default: headroom
    kept between steps) or ``TrackingStep(...)`` (the reservation follows each step's peak)."""

    spill: bool = True
    """Whether records may be spilled to files when demotion is not enough. Without spilling a store
    that cannot fit raises ``PoolBudgetError``."""

    spill_dir: str | os.PathLike[str] | None = None
    """Directory of spill files; ``None`` makes a private temporary one, removed with the pool."""

    pin_memory: bool = False
    """Allocate chunks in page-locked host memory when a CUDA device is present (fast, asynchronous
    device <-> pool copies). Ignored on CPU-only systems, see NOTE [ Host memory ]."""

    def __post_init__(self) -> None:
        ps = self.page_size
        if isinstance(ps, bool) or not isinstance(ps, int) or ps < 4096 or ps & (ps - 1) or ps > 1 << 30:
            raise InvalidArgumentError(f"page_size must be a power of two in [4096, 2**30], got {ps!r}")
        _check_int("initial_bytes", self.initial_bytes, 0)
        if self.budget_bytes is not None:
            _check_int("budget_bytes", self.budget_bytes, 1)
            if self.initial_bytes > self.budget_bytes:
                raise InvalidArgumentError(
                    f"initial_bytes ({self.initial_bytes}) must not exceed budget_bytes ({self.budget_bytes})"
                )
        if not isinstance(self.step, StepPolicy):
            raise InvalidArgumentError(f"step must be a FixedStep, AdaptiveStep, TrackingStep or StepPolicy, got {self.step!r}")
        if not isinstance(self.spill, bool):
            raise InvalidArgumentError(f"spill must be a bool, got {self.spill!r}")
        if self.spill_dir is not None and not isinstance(self.spill_dir, (str, os.PathLike)):
            raise InvalidArgumentError(f"spill_dir must be None or a path, got {self.spill_dir!r}")
        if not isinstance(self.pin_memory, bool):
            raise InvalidArgumentError(f"pin_memory must be a bool, got {self.pin_memory!r}")


@dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of a pool's accounting (taken under its lock)."""

    page_size: int
    total_pages: int
    free_pages: int
    chunks: int
    reserved_bytes: int
    """Bytes of all chunks (``total_pages * page_size``)."""
    used_bytes: int
    """Bytes of pages in use (``(total_pages - free_pages) * page_size``)."""
    payload_bytes: int
    """Bytes of the resident records' tensors (what is actually stored; padding and page tails not)."""
    peak_used_bytes: int
    peak_reserved_bytes: int
    budget_bytes: int | None
    records: int
    """Live records: resident plus spilled."""
    resident_records: int
    spilled_records: int
    spilled_bytes: int
    """Bytes of the spill files of live spilled records."""
    scratch_bytes: int
    """Bytes of the scratch buffers kept for ``borrow`` (not part of ``reserved_bytes``)."""
    demotions: int
    spills: int
    page_ins: int
    grow_events: int
    shrink_events: int
    steps: int

    @property
    def evictions(self) -> int:
        """Demotions plus spills."""
        return self.demotions + self.spills

    @property
    def occupancy(self) -> float:
        """Pages in use over pages reserved."""
        return self.used_bytes / self.reserved_bytes if self.reserved_bytes else 1.0

    @property
    def efficiency(self) -> float:
        """Payload bytes over reserved bytes: page-internal waste and free pages both count."""
        return self.payload_bytes / self.reserved_bytes if self.reserved_bytes else 1.0


class RecordState(enum.Enum):
    RESIDENT = "resident"
    """In pages, as stored."""
    DEMOTED = "demoted"
    """In pages, re-encoded at fewer bits by its demote callback."""
    SPILLED = "spilled"
    """In a spill file (possibly after demotion); ``load`` reads it back."""
    RELEASED = "released"


# ---------------------------------------------------------------------------------------------------
# Internals
# ---------------------------------------------------------------------------------------------------


class _Part(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Layout(NamedTuple):
    parts: tuple[_Part, ...]
    sources: tuple[torch.Tensor, ...]  # flat uint8 views of the payload tensors
    stream_nbytes: int
    payload_nbytes: int
    device: torch.device


def _describe(payload: Sequence[torch.Tensor]) -> _Layout:
    if isinstance(payload, torch.Tensor) or not isinstance(payload, (tuple, list)):
        raise ArgumentTypeError(f"payload must be a tuple of tensors, got {type(payload).__name__}")
    parts, sources, offset, total, device = [], [], 0, 0, None
    for i, t in enumerate(payload):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"payload[{i}] must be a tensor, got {type(t).__name__}")
        if t.is_sparse or t.layout != torch.strided:
            raise ArgumentTypeError(f"payload[{i}] must be a strided (dense) tensor, got layout {t.layout}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise InvalidArgumentError(f"all payload tensors must be on one device, got {device} and {t.device}")
        if t.requires_grad:
            t = t.detach()
        flat = (t if t.is_contiguous() else t.contiguous()).view(-1).view(torch.uint8)
        offset = -(-offset // _PART_ALIGN) * _PART_ALIGN
        parts.append(_Part(t.dtype, tuple(t.shape), offset, flat.numel()))
        sources.append(flat)
        offset += flat.numel()
        total += flat.numel()
    return _Layout(tuple(parts), tuple(sources), offset, total, device or torch.device("cpu"))


def _unflatten(buf: torch.Tensor, parts: tuple[_Part, ...]) -> Payload:
    return tuple(buf[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in parts)


class _Chunk:
    __slots__ = ("data", "free", "npages")

    def __init__(self, data: torch.Tensor, npages: int) -> None:
        self.data, self.npages = data, npages
        # A stack whose top is the list's end: pages pop in ascending order from a fresh chunk.
        self.free: list[int] = list(range(npages - 1, -1, -1))


Run = tuple[int, int, int]  # (chunk id, first page in the chunk, page count)


class _Entry:
    """A record's state; owned by the pool, guarded by its lock. The user holds a ``PooledRecord``."""

    __slots__ = (
        "crc", "demote", "demotions", "device", "importance", "npages", "parts", "payload_nbytes", "pins",
        "release_requested", "runs", "seq", "spill_path", "state", "stream_nbytes",
    )

    def __init__(self, seq: int, importance: float, layout: _Layout, demote: DemoteFn | None) -> None:
        self.seq, self.importance, self.demote = seq, importance, demote
        self.parts, self.stream_nbytes = layout.parts, layout.stream_nbytes
        self.payload_nbytes, self.device = layout.payload_nbytes, layout.device
        self.runs: list[Run] = []
        self.npages = 0
        self.state = RecordState.RESIDENT
        self.demotions = 0
        self.spill_path: Path | None = None
        self.crc = 0
        self.pins = 0  # open borrow() blocks: not evictable, release deferred
        self.release_requested = False

    @property
    def key(self) -> tuple[float, int]:
        return (self.importance, self.seq)


# NOTE [ Page lifetime rules ]
#   1. A page is either on exactly one chunk's free stack or owned by exactly one record (its runs);
#      ``used_pages + sum(len(chunk.free)) == total_pages`` at every lock release.
#   2. Pages are taken for a record under the lock *before* its bytes are copied; the copy itself
#      runs outside the lock (the record is not yet in the importance index, so nothing can evict or
#      move it), then the record is published in the index under the lock.
#   3. ``load`` reads pages, never frees them. ``release`` (explicit, from ``__del__`` as a safety
#      net, or from ``close``) gives them back and is idempotent.
#   4. Freed pages are pushed so that the next pops return them in ascending order: a record usually
#      gets one run of consecutive pages, and ``store``/``load`` copy run by run.
#   5. Allocation takes the pages from the lowest-numbered chunk that can hold the whole record, else
#      spreads it from the lowest chunk up, so trailing chunks drain and can be freed at a step
#      boundary; only a chunk with *all* its pages free is ever freed.
#   6. Demotion rewrites a record into a prefix of its own pages and frees the tail; spilling writes
#      its file first and frees its pages only once the write succeeded. Neither happens to a record
#      more important than (or as important and newer than) the one that needs the room.
#   7. A spilled record is paged back in by ``prefetch`` (which may evict less important records) or
#      by ``load(page_in=True)`` when its pages fit without evicting anything.
#   8. ``borrow`` pins a resident one-run record: while pinned it is never demoted or spilled, and a
#      ``release`` is deferred to the end of the last borrow, so the views it hands out stay valid
#      inside the ``with`` block (and only there: after it the pages may hold another record). The
#      views keep the chunk's storage alive, so even a misuse never touches unmapped memory.

# NOTE [ Eviction order ]
# Records are keyed (importance, insertion number) in a SortedList: equal importance evicts the older
# record first (in a training step the first saved is the last needed by backward). A store that
# would exceed the budget makes room from the records with a smaller key, strictly in key order:
#   1. demote: the least important record, if it has a demote callback, is re-encoded one level down
#      (the callback returns a smaller payload, or None when it cannot go further) into a prefix of
#      its pages; it stays the least important, so it is demoted again until it is at its floor;
#   2. spill: a least important record that cannot be demoted (any more) is spilled; the next one
#      becomes the least important and the loop goes on until enough pages are free.
# So precision is only ever lost on the least important records, and a more important record is
# never demoted to spare a less important one from spilling (spilling is lossless, it only costs
# I/O). If that is not enough, the new record itself is demoted (outside the lock) until it fits; if
# it never fits it is spilled straight to a file as it was given (its demotion would gain nothing).
# With spilling disabled, records that cannot be demoted are skipped and a store that still does not
# fit raises ``PoolBudgetError`` (after the demotions, which leave every record valid). Nothing is
# lost silently. When spilling is enabled but even evicting every less important record could not
# make room, nothing is evicted for it.

# NOTE [ Locking ]
# One ``threading.Lock`` guards the chunks, free stacks, index and counters. Copies into a new
# record's pages run outside it (rule 2); gathers for ``load``, demote callbacks and spill I/O of
# *evicted* records run under it, because the pages they touch could otherwise be evicted or reused
# by another thread; reads of ``borrow``'s views run outside it, the record being pinned (rule 8).
# A demote callback must therefore not call into the pool. ``PooledRecord.__del__``
# may run inside a locked section of the same thread (garbage collection), so it never blocks: if the
# lock is taken it queues the release (a deque append is atomic) and the next locked operation
# performs it.

# NOTE [ Host memory ]
# On CPU each chunk is its own anonymous ``mmap`` (``MAP_POPULATE`` where the platform has it, else
# written once), wrapped with ``torch.frombuffer``: every page is faulted in when the chunk is
# reserved, never on the hot path, and a freed chunk goes straight back to the OS (the tensor holds
# the mmap object; dropping it unmaps). Going through malloc instead (``torch.zeros``) would leave the
# pool's resident memory to glibc's heuristics: chunks under its dynamic mmap threshold (up to 32 MB)
# come from the heap and stay resident after they are freed. Where ``mmap`` is unavailable the pool
# falls back to ``torch.zeros``.
# Pinned host memory: on a CUDA system with ``pin_memory=True`` the chunks are allocated with
# ``torch.zeros(..., pin_memory=True)`` (page-locked, from CUDA's caching host allocator), so records
# of device tensors are copied device -> pool by DMA and ``load`` copies the gathered bytes back to
# the record's device in one transfer. The pool never holds device memory: GPU activations go to
# pinned host pages.


class PooledRecord:
    """The handle of one stored record. ``load`` it, ``release`` it when backward no longer needs it."""

    __slots__ = ("__weakref__", "_entry", "_pool")

    def __init__(self, pool: PagePool, entry: _Entry) -> None:
        self._pool, self._entry = pool, entry

    @property
    def importance(self) -> float:
        return self._entry.importance

    @property
    def state(self) -> RecordState:
        return self._entry.state

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (after any demotion)."""
        return self._entry.payload_nbytes

    @property
    def num_pages(self) -> int:
        """Pages held now (0 when spilled or released)."""
        return self._entry.npages

    @property
    def demotions(self) -> int:
        return self._entry.demotions

    def load(self, *, page_in: bool = True) -> Payload:
        """Fresh tensors bit-equal to what was stored (or to the latest demoted payload).

        Pages are read, not freed. A spilled record is read back from its file (its CRC checked,
        ``PoolError`` on corruption) and, with ``page_in``, paged back in when that fits without
        evicting anything. Pass ``page_in=False`` when the record is released right after (backward's
        last use): paging it in would only copy it into pages that are freed at once.
        """
        return self._pool._load(self._entry, page_in)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Payload]:
        """Zero-copy access for the duration of a ``with`` block::

            with rec.borrow() as (lo, scale, codes):
                x = decode(lo, scale, codes)   # reads the pool's pages directly
            rec.release()

        A resident record held in one run of pages (the usual case) yields views of its pages and is
        pinned meanwhile: not evicted, and a ``release`` inside the block takes effect at its end.
        A record spread over several runs, or spilled, is gathered (read) into a scratch buffer that
        the pool reuses from block to block (NOTE [ Scratch buffers ]). Either way the tensors must
        not be used after the block. Records stored from a device yield a fresh copy on that device.
        """
        payload, pinned, scratch = self._pool._borrow_begin(self._entry)
        try:
            yield payload
        finally:
            if pinned or scratch is not None:
                self._pool._borrow_end(self._entry, pinned, scratch)

    def release(self) -> None:
        """Give the record's pages (or spill file) back to the pool. Idempotent."""
        self._pool._release(self._entry)

    def __del__(self) -> None:
        try:
            self._pool._release(self._entry, blocking=False)
        except Exception:
            pass

    def __repr__(self) -> str:
        e = self._entry
        return (
            f"PooledRecord(seq={e.seq}, importance={e.importance}, state={e.state.value}, "
            f"nbytes={e.payload_nbytes}, pages={e.npages}, demotions={e.demotions})"
        )


def _host_region(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of zeroed, resident host memory as a uint8 tensor (NOTE [ Host memory ])."""
    if pinned:
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags:  # not a POSIX mmap (Windows)
        return torch.zeros(nbytes, dtype=torch.uint8)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(-1, nbytes, flags=flags | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive; unmapped with it
    if not populate:
        data.zero_()  # fault every page in now, not on the hot path
    return data


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class PagePool:
    """A paged, budgeted, importance-aware store for packed records. See the module docstring."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        config = config if config is not None else PoolConfig()
        if not isinstance(config, PoolConfig):
            raise ArgumentTypeError(f"config must be a PoolConfig, got {type(config).__name__}")
        self.config = config
        self._ps = config.page_size
        self._policy: StepPolicy = config.step
        self._pinned = bool(config.pin_memory and torch.cuda.is_available())
        self._lock = threading.Lock()
        self._pending: deque[_Entry] = deque()
        self._chunks: list[_Chunk] = []
        self._scratch: list[torch.Tensor] = []
        self._scratch_need = 0  # largest scratch request of the current step
        self._index: SortedList = SortedList()
        self._live: dict[int, _Entry] = {}
        self._budget_pages: int | None = None if config.budget_bytes is None else config.budget_bytes // self._ps
        self._budget_bytes = config.budget_bytes
        self._demand = Demand()
        self._next_seq = 0
        self._closed = False
        self._token = uuid.uuid4().hex[:8]
        # counters (guarded by the lock)
        self._total_pages = self._used_pages = 0
        self._payload_bytes = self._spilled_bytes = self._spilled_records = 0
        self._peak_used_pages = self._peak_total_pages = self._step_peak_pages = 0
        self._demotions = self._spills = self._page_ins = self._grow_events = self._shrink_events = 0
        self._steps = 0
        if config.spill_dir is None:
            self._spill_dir: Path | None = None  # made on first spill, see _spill_path
            self._owned_dir: str | None = None
        else:
            self._spill_dir = Path(config.spill_dir)
            self._owned_dir = None
        self._finalizer: weakref.finalize | None = None
        if config.initial_bytes:
            with self._lock:
                self._add_chunk(-(-config.initial_bytes // self._ps))

    # -- public API ----------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self._ps

    @property
    def pinned(self) -> bool:
        """Whether chunks live in page-locked host memory."""
        return self._pinned

    def store(self, payload: Sequence[torch.Tensor], importance: float, *,
              demote: DemoteFn | None = None) -> PooledRecord:
        """Copy ``payload`` (a tuple of tensors) into pages and return its handle.

        ``importance`` orders eviction (lower goes first). ``demote``, if given, maps a payload to a
        smaller one at fewer bits (or ``None`` when it cannot go further); the pool calls it when it
        needs room, and ``load`` then returns the demoted payload. Raises ``PoolBudgetError`` when
        the record cannot fit and spilling is disabled.
        """
        layout = _describe(payload)
        importance = self._check_importance(importance)
        if demote is not None and not callable(demote):
            raise ArgumentTypeError(f"demote must be callable or None, got {type(demote).__name__}")
        with self._lock:
            self._check_open()
            self._drain()
            seq = self._next_seq
            self._next_seq += 1
            entry = _Entry(seq, importance, layout, demote)
            runs = self._reserve(self._pages_for(layout.stream_nbytes), entry.key, evict=True)
            if runs is not None:
                self._claim(entry, runs)
                segments = self._segments(runs, layout.stream_nbytes)
        if runs is None and demote is not None:
            layout, runs, segments = self._store_demoted(entry, layout, demote)
        if runs is not None:
            self._copy_in(layout, segments)
            with self._lock:
                if not self._publish(entry):
                    raise PoolError("the pool was closed during the store")
        elif self.config.spill:
            self._spill_new(entry, layout)
        else:
            with self._lock:
                used, budget = self._used_pages * self._ps, self._budget_bytes
            raise PoolBudgetError(
                layout.stream_nbytes, budget or 0, used,
                f"{self._pages_for(layout.stream_nbytes)} pages of {self._ps} bytes; nothing less important "
                "can be demoted and spilling is disabled",
            )
        return PooledRecord(self, entry)

    def prefetch(self, record: PooledRecord) -> bool:
        """Page a spilled record back in ahead of ``load`` (evicting less important records if the
        budget needs it). Returns whether the record is resident afterwards."""
        entry = record._entry
        with self._lock:
            self._check_open()
            self._drain()
            if entry.state is RecordState.RELEASED:
                raise PoolError(f"record {entry.seq} was released")
            if entry.state is not RecordState.SPILLED:
                return True
            buf = self._read_spill(entry)
            return self._page_in(entry, buf, evict=True)

    def set_budget(self, budget_bytes: int | None) -> None:
        """Change the byte budget. A lower budget makes the next stores evict; trailing free chunks
        above it are freed now."""
        if budget_bytes is not None:
            _check_int("budget_bytes", budget_bytes, 1)
        with self._lock:
            self._drain()
            self._budget_bytes = budget_bytes
            self._budget_pages = None if budget_bytes is None else budget_bytes // self._ps
            self._shrink(self._total_pages)

    def end_step(self) -> None:
        """Mark a training-step boundary: the step policy observes the step's peak usage and trailing
        free chunks beyond what it wants to keep are freed."""
        with self._lock:
            self._check_open()
            self._drain()
            self._demand = self._policy.observe(self._demand, self._step_peak_pages * self._ps)
            keep = self._pages_for(max(0, self._policy.keep_bytes(self._demand)))
            if self._budget_pages is not None:
                keep = min(keep, self._budget_pages)
            keep = max(keep, self._used_pages)
            limit = keep + self._pages_for(max(0, self._policy.slack_bytes(keep * self._ps)))
            over_budget = self._budget_pages is not None and self._total_pages > self._budget_pages
            if self._total_pages > limit or over_budget:
                self._shrink(keep)
            self._step_peak_pages = self._used_pages
            self._steps += 1
            self._scratch = [b for b in self._scratch if b.numel() <= 2 * self._scratch_need]
            self._scratch_need = 0

    def stats(self) -> PoolStats:
        """A consistent snapshot of the accounting."""
        with self._lock:
            self._drain()
            free = self._total_pages - self._used_pages
            return PoolStats(
                page_size=self._ps,
                total_pages=self._total_pages,
                free_pages=free,
                chunks=len(self._chunks),
                reserved_bytes=self._total_pages * self._ps,
                used_bytes=self._used_pages * self._ps,
                payload_bytes=self._payload_bytes,
                peak_used_bytes=self._peak_used_pages * self._ps,
                peak_reserved_bytes=self._peak_total_pages * self._ps,
                budget_bytes=self._budget_bytes,
                records=len(self._live),
                resident_records=len(self._live) - self._spilled_records,
                spilled_records=self._spilled_records,
                spilled_bytes=self._spilled_bytes,
                scratch_bytes=sum(b.numel() for b in self._scratch),
                demotions=self._demotions,
                spills=self._spills,
                page_ins=self._page_ins,
                grow_events=self._grow_events,
                shrink_events=self._shrink_events,
                steps=self._steps,
            )

    def check(self) -> None:
        """Verify the page accounting invariants (NOTE [ Page lifetime rules ] 1); raises PoolError."""
        with self._lock:
            self._drain()
            free = sum(len(c.free) for c in self._chunks)
            owned = sum(e.npages for e in self._live.values())
            seen: set[tuple[int, int]] = set()
            for c_id, c in enumerate(self._chunks):
                seen.update((c_id, p) for p in c.free)
            for e in self._live.values():
                for c_id, first, count in e.runs:
                    seen.update((c_id, p) for p in range(first, first + count))
            problems = []
            if sum(c.npages for c in self._chunks) != self._total_pages:
                problems.append("chunk pages do not add up to total_pages")
            if free + self._used_pages != self._total_pages:
                problems.append(f"free {free} + used {self._used_pages} != total {self._total_pages}")
            if owned > self._used_pages:
                problems.append(f"records own {owned} pages but only {self._used_pages} are in use")
            if len(seen) != free + owned:
                problems.append("a page is both free and owned, or owned twice")
            if len(self._index) > len(self._live) - self._spilled_records:
                problems.append("more index entries than resident records")
            published = sum(e.payload_nbytes for e in self._live.values() if e.key in self._index)
            if published != self._payload_bytes:
                problems.append(f"payload_bytes {self._payload_bytes} != {published} held by indexed records")
            if problems:
                raise PoolError("pool accounting is inconsistent: " + "; ".join(problems))

    def close(self) -> None:
        """Release every record, free all chunks and remove the pool's own spill directory."""
        with self._lock:
            if self._closed:
                return
            self._drain()
            for entry in list(self._live.values()):
                entry.pins = 0
                self._release_locked(entry)
            self._chunks.clear()
            self._scratch.clear()
            self._total_pages = 0
            self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PagePool(page_size={s.page_size}, reserved={s.reserved_bytes}, used={s.used_bytes}, "
            f"records={s.records}, budget={s.budget_bytes}, step={self._policy!r})"
        )

    # -- store helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _check_importance(importance: float) -> float:
        if isinstance(importance, bool) or not isinstance(importance, numbers.Real):
            raise ArgumentTypeError(f"importance must be a number, got {type(importance).__name__}")
        importance = float(importance)
        if not math.isfinite(importance):
            raise InvalidArgumentError(f"importance must be finite, got {importance}")
        return importance

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed")

    def _pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self._ps)

    def _store_demoted(self, entry: _Entry, layout: _Layout, demote: DemoteFn):
        """No room for the new record even after evicting everything less important: demote it
        (outside the lock) until it fits. Returns the original layout and no runs when it never fits:
        it is then spilled as given."""
        current, demotions = layout, 0
        while True:
            new = demote(tuple(_unflatten_sources(current)))
            if new is None:
                return layout, None, None
            new_layout = _describe(tuple(new))
            if self._pages_for(new_layout.stream_nbytes) >= self._pages_for(current.stream_nbytes):
                return layout, None, None
            current, demotions = new_layout, demotions + 1
            with self._lock:
                self._check_open()
                runs = self._reserve(self._pages_for(current.stream_nbytes), entry.key, evict=True)
                if runs is None:
                    continue
                entry.parts, entry.stream_nbytes = current.parts, current.stream_nbytes
                entry.payload_nbytes = current.payload_nbytes
                entry.demotions += demotions
                entry.state = RecordState.DEMOTED
                self._demotions += demotions
                self._claim(entry, runs)
                return current, runs, self._segments(runs, current.stream_nbytes)

    def _claim(self, entry: _Entry, runs: list[Run]) -> None:
        entry.runs = runs
        entry.npages = sum(r[2] for r in runs)
        self._live[entry.seq] = entry

    def _publish(self, entry: _Entry) -> bool:
        if entry.state is RecordState.RELEASED:  # the pool was closed while we copied
            return False
        self._index.add(entry.key)
        self._payload_bytes += entry.payload_nbytes
        return True

    def _copy_in(self, layout: _Layout, segments: list[tuple[torch.Tensor, int, int, int]]) -> None:
        if len(segments) == 1:  # one run of pages: the common case
            data, doff, _, _ = segments[0]
            for part, src in zip(layout.parts, layout.sources, strict=True):
                if part.nbytes:
                    data[doff + part.offset : doff + part.offset + part.nbytes].copy_(src)
            return
        for part, src in zip(layout.parts, layout.sources, strict=True):
            lo, hi = part.offset, part.offset + part.nbytes
            for data, doff, soff, n in segments:
                a, b = max(lo, soff), min(hi, soff + n)
                if a < b:
                    data[doff + a - soff : doff + b - soff].copy_(src[a - lo : b - lo])

    def _segments(self, runs: list[Run], nbytes: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """(chunk data, byte offset in the chunk, stream offset, length) for the first ``nbytes``."""
        out, pos, ps = [], 0, self._ps
        for c_id, first, count in runs:
            if pos >= nbytes:
                break
            n = min(count * ps, nbytes - pos)
            out.append((self._chunks[c_id].data, first * ps, pos, n))
            pos += n
        return out

    # -- pages -----------------------------------------------------------------------------------------
    def _reserve(self, need: int, key: tuple[float, int], *, evict: bool) -> list[Run] | None:
        """Take ``need`` pages within the budget (evicting records with a smaller key when ``evict``)
        and growing if the chunks are short; ``None`` when the budget does not allow it."""
        if need == 0:
            return []
        bp = self._budget_pages
        if bp is not None and self._used_pages + need > bp:
            if not evict or not self._make_room(need, key):
                return None
        free = self._total_pages - self._used_pages
        if free < need:
            self._grow(need - free)
        return self._take(need)

    def _take(self, need: int) -> list[Run]:
        # The lowest chunk that holds the whole record, so that most records are one run of pages
        # (a single copy each way, and ``borrow`` can hand out views); else spread from the lowest.
        chunks: list[tuple[int, _Chunk]] = list(enumerate(self._chunks))
        for c_id, chunk in chunks:
            if len(chunk.free) >= need:
                chunks = [(c_id, chunk)]
                break
        runs: list[Run] = []
        left = need
        for c_id, chunk in chunks:
            if not chunk.free:
                continue
            k = min(left, len(chunk.free))
            taken = chunk.free[-k:]
            del chunk.free[-k:]
            for p in reversed(taken):
                if runs and runs[-1][0] == c_id and runs[-1][1] + runs[-1][2] == p:
                    c, f, n = runs[-1]
                    runs[-1] = (c, f, n + 1)
                else:
                    runs.append((c_id, p, 1))
            left -= k
            if left == 0:
                break
        assert left == 0, "free page count out of sync"
        self._used_pages += need
        if self._used_pages > self._step_peak_pages:
            self._step_peak_pages = self._used_pages
            if self._used_pages > self._peak_used_pages:
                self._peak_used_pages = self._used_pages
        return runs

    def _give_back(self, runs: list[Run]) -> None:
        n = 0
        for c_id, first, count in reversed(runs):
            self._chunks[c_id].free.extend(range(first + count - 1, first - 1, -1))
            n += count
        self._used_pages -= n

    def _add_chunk(self, npages: int) -> None:
        try:
            data = _host_region(npages * self._ps, self._pinned)
        except (RuntimeError, OSError) as exc:
            raise PoolError(f"cannot reserve {npages * self._ps} bytes for the pool: {exc}") from exc
        self._chunks.append(_Chunk(data, npages))
        self._total_pages += npages
        self._peak_total_pages = max(self._peak_total_pages, self._total_pages)
        self._grow_events += 1

    def _grow(self, shortfall: int) -> None:
        sizes = self._policy.plan_growth(shortfall * self._ps, self._total_pages * self._ps, self._demand)
        pages = [self._pages_for(max(1, int(s))) for s in sizes]
        if sum(pages) < shortfall:
            pages.append(shortfall - sum(pages))
        if self._budget_pages is not None:
            allowed = self._budget_pages - self._total_pages  # >= shortfall, see _reserve
            while pages and sum(pages) > allowed:
                excess = sum(pages) - allowed
                if pages[-1] > excess:
                    pages[-1] -= excess
                else:
                    pages.pop()
        for n in pages:
            self._add_chunk(n)

    def _shrink(self, keep_pages: int) -> None:
        """Free trailing entirely-free chunks while the rest holds ``keep_pages`` (and the budget)."""
        bp = self._budget_pages
        while self._chunks:
            last = self._chunks[-1]
            if len(last.free) != last.npages:
                break
            over_budget = bp is not None and self._total_pages > bp
            if not over_budget and self._total_pages - last.npages < keep_pages:
                break
            self._chunks.pop()
            self._total_pages -= last.npages
            self._shrink_events += 1

    # -- eviction --------------------------------------------------------------------------------------
    def _room(self, need: int) -> bool:
        return self._budget_pages is None or self._used_pages + need <= self._budget_pages

    def _make_room(self, need: int, key: tuple[float, int]) -> bool:
        """Evict records with a key below ``key`` (NOTE [ Eviction order ]) until ``need`` fits."""
        assert self._budget_pages is not None
        if need > self._budget_pages:
            return False
        candidates = self._index.irange(maximum=key, inclusive=(True, False))
        if self.config.spill:
            reclaimable = sum(self._live[seq].npages for _, seq in candidates if not self._live[seq].pins)
            if self._used_pages - reclaimable + need > self._budget_pages:
                return False  # hopeless: evict nothing for it
        spill = self.config.spill
        while not self._room(need):
            victim = None
            for _, seq in self._index.irange(maximum=key, inclusive=(True, False)):
                entry = self._live[seq]
                if not entry.pins and (spill or entry.demote is not None):
                    victim = entry
                    break
            if victim is None:
                return False
            if victim.demote is not None:
                self._demote(victim)  # shrinks it, or clears its callback when it cannot
            else:
                self._spill(victim)
        return True

    def _demote(self, entry: _Entry) -> None:
        """Re-encode a resident record one level down, into a prefix of its own pages."""
        payload = _unflatten(self._gather(entry), entry.parts)
        try:
            new = entry.demote(payload)  # type: ignore[misc]
        except Exception as exc:
            entry.demote = None
            raise PoolError(f"the demote callback of record {entry.seq} failed: {exc}") from exc
        if new is None:
            entry.demote = None
            return
        layout = _describe(tuple(new))
        npages = self._pages_for(layout.stream_nbytes)
        if npages >= entry.npages:
            entry.demote = None  # no progress: it will be spilled if need be
            return
        keep, tail, left = [], [], npages
        for c_id, first, count in entry.runs:
            k = min(left, count)
            if k:
                keep.append((c_id, first, k))
            if count > k:
                tail.append((c_id, first + k, count - k))
            left -= k
        self._copy_in(layout, self._segments(keep, layout.stream_nbytes))
        self._give_back(tail)
        self._payload_bytes += layout.payload_nbytes - entry.payload_nbytes
        entry.parts, entry.stream_nbytes = layout.parts, layout.stream_nbytes
        entry.payload_nbytes = layout.payload_nbytes
        entry.runs, entry.npages = keep, npages
        entry.demotions += 1
        entry.state = RecordState.DEMOTED
        self._demotions += 1

    # -- spill files -------------------------------------------------------------------------------------
    def _spill_path(self, seq: int) -> Path:
        if self._spill_dir is None:
            self._owned_dir = tempfile.mkdtemp(prefix="daftrain-pool-")
            self._spill_dir = Path(self._owned_dir)
            self._finalizer = weakref.finalize(self, _remove_dir, self._owned_dir)
        return self._spill_dir / f"{self._token}-{seq:012d}.spill"

    def _write_spill(self, path: Path, seq: int, nbytes: int, pieces) -> int:
        crc = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(_SPILL_HEADER.pack(_SPILL_MAGIC, seq, nbytes))
                for piece in pieces:
                    mv = memoryview(piece.numpy()) if isinstance(piece, torch.Tensor) else piece
                    crc = zlib.crc32(mv, crc)
                    f.write(mv)
                f.write(_SPILL_TRAILER.pack(crc))
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise PoolError(f"cannot spill record {seq} to {path}: {exc}") from exc
        return crc

    def _spill(self, entry: _Entry) -> None:
        """Write a resident record's stream to its file, then free its pages (lock held)."""
        path = self._spill_path(entry.seq)
        pieces = [data[doff : doff + n] for data, doff, _, n in self._segments(entry.runs, entry.stream_nbytes)]
        if any(p.device.type != "cpu" for p in pieces):  # pragma: no cover - pool memory is host memory
            pieces = [p.cpu() for p in pieces]
        entry.crc = self._write_spill(path, entry.seq, entry.stream_nbytes, pieces)
        self._index.remove(entry.key)
        self._give_back(entry.runs)
        self._payload_bytes -= entry.payload_nbytes
        entry.runs, entry.npages = [], 0
        entry.spill_path, entry.state = path, RecordState.SPILLED
        self._spilled_records += 1
        self._spilled_bytes += entry.stream_nbytes
        self._spills += 1

    def _spill_new(self, entry: _Entry, layout: _Layout) -> None:
        """Spill a record that never got pages (it is the least important one that does not fit)."""
        with self._lock:
            self._check_open()
            path = self._spill_path(entry.seq)
        pieces, pos = [], 0
        for part, src in zip(layout.parts, layout.sources, strict=True):
            if part.offset > pos:
                pieces.append(bytes(part.offset - pos))
            pieces.append(src.cpu())
            pos = part.offset + part.nbytes
        entry.crc = self._write_spill(path, entry.seq, layout.stream_nbytes, pieces)
        with self._lock:
            entry.spill_path, entry.state = path, RecordState.SPILLED
            if self._closed:
                entry.state = RecordState.RELEASED
                path.unlink(missing_ok=True)
                raise PoolError("the pool is closed")
            self._live[entry.seq] = entry
            self._spilled_records += 1
            self._spilled_bytes += entry.stream_nbytes
            self._spills += 1

    def _read_spill(self, entry: _Entry, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read and verify a spilled record's stream into a fresh buffer or ``out`` (lock held)."""
        path = entry.spill_path
        assert path is not None
        if out is None:
            buf = torch.empty(entry.stream_nbytes, dtype=torch.uint8)
        else:
            buf = out[: entry.stream_nbytes]
        try:
            with open(path, "rb") as f:
                header = f.read(_SPILL_HEADER.size)
                if len(header) != _SPILL_HEADER.size:
                    raise PoolError(f"spill file {path} of record {entry.seq} is truncated (no header)")
                magic, seq, nbytes = _SPILL_HEADER.unpack(header)
                if magic != _SPILL_MAGIC or seq != entry.seq or nbytes != entry.stream_nbytes:
                    raise PoolError(
                        f"spill file {path} of record {entry.seq} is corrupted: bad header "
                        f"(magic {magic!r}, record {seq}, {nbytes} bytes; expected record {entry.seq}, "
                        f"{entry.stream_nbytes} bytes)"
                    )
                arr = buf.numpy()
                got = f.readinto(memoryview(arr)) if entry.stream_nbytes else 0
                trailer = f.read(_SPILL_TRAILER.size)
                extra = f.read(1)
        except FileNotFoundError as exc:
            raise PoolError(f"spill file {path} of record {entry.seq} is missing") from exc
        except OSError as exc:
            raise PoolError(f"cannot read spill file {path} of record {entry.seq}: {exc}") from exc
        if got != entry.stream_nbytes or len(trailer) != _SPILL_TRAILER.size or extra:
            raise PoolError(f"spill file {path} of record {entry.seq} is truncated or has trailing bytes")
        crc = zlib.crc32(memoryview(buf.numpy()))
        (stored,) = _SPILL_TRAILER.unpack(trailer)
        if crc != entry.crc or stored != entry.crc:
            raise PoolError(
                f"spill file {path} of record {entry.seq} is corrupted: CRC32 {crc:#010x}, "
                f"file says {stored:#010x}, written {entry.crc:#010x}"
            )
        return buf

    def _page_in(self, entry: _Entry, buf: torch.Tensor, *, evict: bool) -> bool:
        """Move a verified spilled record back into pages (lock held); False when it does not fit."""
        runs = self._reserve(self._pages_for(entry.stream_nbytes), entry.key, evict=evict)
        if runs is None:
            return False
        for data, doff, soff, n in self._segments(runs, entry.stream_nbytes):
            data[doff : doff + n].copy_(buf[soff : soff + n])
        assert entry.spill_path is not None
        entry.spill_path.unlink(missing_ok=True)
        entry.spill_path = None
        entry.runs, entry.npages = runs, sum(r[2] for r in runs)
        entry.state = RecordState.DEMOTED if entry.demotions else RecordState.RESIDENT
        self._spilled_records -= 1
        self._spilled_bytes -= entry.stream_nbytes
        self._index.add(entry.key)
        self._payload_bytes += entry.payload_nbytes
        self._page_ins += 1
        return True

    # -- load / release --------------------------------------------------------------------------------
    def _gather(self, entry: _Entry, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            buf = torch.empty(entry.stream_nbytes, dtype=torch.uint8)
        else:
            buf = out[: entry.stream_nbytes]
        for data, doff, soff, n in self._segments(entry.runs, entry.stream_nbytes):
            buf[soff : soff + n].copy_(data[doff : doff + n])
        return buf

    def _load(self, entry: _Entry, page_in: bool = True) -> Payload:
        with self._lock:
            self._check_open()
            self._drain()
            if entry.state is RecordState.RELEASED or entry.release_requested:
                raise PoolError(f"record {entry.seq} was released")
            if entry.state is RecordState.SPILLED:
                buf = self._read_spill(entry)
                if page_in:
                    self._page_in(entry, buf, evict=False)
            else:
                buf = self._gather(entry)
            parts, device = entry.parts, entry.device
        if device.type != "cpu":
            buf = buf.to(device)
        return _unflatten(buf, parts)

    def _borrow_begin(self, entry: _Entry) -> tuple[Payload, bool, torch.Tensor | None]:
        with self._lock:
            self._check_open()
            self._drain()
            if entry.state is RecordState.RELEASED or entry.release_requested:
                raise PoolError(f"record {entry.seq} was released")
            if entry.device.type != "cpu":
                buf = self._read_spill(entry) if entry.state is RecordState.SPILLED else self._gather(entry)
                parts, device = entry.parts, entry.device
            elif entry.state is RecordState.SPILLED or len(entry.runs) > 1:
                scratch = self._scratch_take(entry.stream_nbytes)
                try:
                    if entry.state is RecordState.SPILLED:
                        buf = self._read_spill(entry, out=scratch)
                    else:
                        buf = self._gather(entry, out=scratch)
                except BaseException:
                    self._scratch_give(scratch)
                    raise
                return _unflatten(buf, entry.parts), False, scratch
            else:
                if entry.runs:
                    c_id, first, _ = entry.runs[0]
                    start = first * self._ps
                    region = self._chunks[c_id].data[start : start + entry.stream_nbytes]
                else:
                    region = torch.empty(0, dtype=torch.uint8)
                entry.pins += 1
                return _unflatten(region, entry.parts), True, None
        return _unflatten(buf.to(device), parts), False, None

    def _borrow_end(self, entry: _Entry, pinned: bool, scratch: torch.Tensor | None) -> None:
        with self._lock:
            if scratch is not None and not self._closed:
                self._scratch_give(scratch)
            if not pinned or entry.pins == 0:  # (pins == 0: the pool was closed inside the block)
                return
            entry.pins -= 1
            if entry.pins == 0 and entry.release_requested:
                entry.release_requested = False
                self._release_locked(entry)
            self._drain()

    # NOTE [ Scratch buffers ]
    # ``borrow`` of a record that is not one run of pages (it spans chunks, or it is spilled) needs
    # contiguous bytes for the block's duration only, so instead of a fresh allocation per call (the
    # very per-record allocation the pool exists to avoid: malloc keeps such buffers resident) it
    # gathers into a scratch buffer: host memory from the same mmap source as the chunks, taken from a
    # small free list (the smallest one that fits) and given back at the end of the block. At most
    # ``_MAX_SCRATCH`` buffers are kept (the largest), so a pool holds about its largest straddling
    # record; another is allocated only while more blocks are open at once (nested or concurrent
    # borrows). At ``end_step`` kept buffers larger than twice the step's largest request are freed
    # (all of them after a step that needed none), so scratch follows demand like the chunks do.

    def _scratch_take(self, nbytes: int) -> torch.Tensor:
        self._scratch_need = max(self._scratch_need, nbytes)
        fits = [i for i, b in enumerate(self._scratch) if b.numel() >= nbytes]
        if fits:
            return self._scratch.pop(min(fits, key=lambda i: self._scratch[i].numel()))
        return _host_region(max(1, self._pages_for(nbytes)) * self._ps, self._pinned)

    def _scratch_give(self, buf: torch.Tensor) -> None:
        self._scratch.append(buf)
        self._scratch.sort(key=lambda b: b.numel(), reverse=True)
        del self._scratch[_MAX_SCRATCH:]

    def _release(self, entry: _Entry, *, blocking: bool = True) -> None:
        if entry.state is RecordState.RELEASED:
            return
        if not self._lock.acquire(blocking=blocking):
            self._pending.append(entry)
            return
        try:
            self._drain()
            self._release_locked(entry)
        finally:
            self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            self._release_locked(self._pending.popleft())

    def _release_locked(self, entry: _Entry) -> None:
        if entry.state is RecordState.RELEASED or self._live.get(entry.seq) is not entry:
            entry.state = RecordState.RELEASED
            return
        if entry.pins:  # borrowed: the last borrow to end releases it (NOTE [ Page lifetime rules ] 8)
            entry.release_requested = True
            return
        if entry.state is RecordState.SPILLED:
            if entry.spill_path is not None:
                entry.spill_path.unlink(missing_ok=True)
            self._spilled_records -= 1
            self._spilled_bytes -= entry.stream_nbytes
        else:
            published = entry.key in self._index
            if published:
                self._index.remove(entry.key)
                self._payload_bytes -= entry.payload_nbytes
            self._give_back(entry.runs)
            entry.runs, entry.npages = [], 0
        del self._live[entry.seq]
        entry.state = RecordState.RELEASED


def _unflatten_sources(layout: _Layout) -> Payload:
    """The payload tensors again, from their flat byte views (for a demote callback)."""
    return tuple(src.view(p.dtype).view(p.shape) for p, src in zip(layout.parts, layout.sources, strict=True))
