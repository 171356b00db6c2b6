"""How a ``PagePool`` grows and shrinks its reservation: the growth policies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import InvalidArgumentError

__all__ = ["AdaptiveGrowth", "Demand", "FixedGrowth", "GrowthPolicy", "TrackingGrowth"]

KIB = 1 << 10
MIB = 1 << 20


@dataclass(frozen=True)
class Demand:
    """What the pool has observed of per-step peak usage (bytes); updated at each ``end_step``."""

    steps: int = 0
    last_peak: int = 0
    mean: float = 0.0
    dev: float = 0.0


@runtime_checkable
class GrowthPolicy(Protocol):
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
class FixedGrowth:
    """Grow and shrink in fixed steps of ``step_bytes`` (DAF uses 100 MB).

    Growth allocates as many ``step_bytes`` chunks as the shortfall needs; at a step boundary the
    trailing entirely free chunks are freed as long as what remains holds the last step's peak.
    """

    step_bytes: int = 100 * MIB

    def __post_init__(self) -> None:
        _check_int("FixedGrowth.step_bytes", self.step_bytes, 1)

    def observe(self, demand: Demand, step_peak_bytes: int) -> Demand:
        return Demand(demand.steps + 1, step_peak_bytes, float(step_peak_bytes), 0.0)

    def plan_growth(self, shortfall_bytes: int, reserved_bytes: int, demand: Demand) -> list[int]:
        return [self.step_bytes] * max(1, -(-shortfall_bytes // self.step_bytes))

    def keep_bytes(self, demand: Demand) -> int:
        return demand.last_peak

    def slack_bytes(self, keep_bytes: int) -> int:
        return 0


def _observe_peak(demand: Demand, step_peak_bytes: int, gain: float, dev_gain: float) -> Demand:
    """The EMA update of NOTE [ Adaptive growth rule ] (shared by ``AdaptiveGrowth`` and ``TrackingGrowth``)."""
    p = float(step_peak_bytes)
    if demand.steps == 0:
        return Demand(1, step_peak_bytes, p, p / 8)
    dev = (1 - dev_gain) * demand.dev + dev_gain * abs(p - demand.mean)
    mean = (1 - gain) * demand.mean + gain * p
    return Demand(demand.steps + 1, step_peak_bytes, mean, dev)


# NOTE [ Adaptive growth rule ]
# The adaptive policy sizes the pool from the observed per-step peak usage ``p`` (bytes of pages in
# use at the busiest moment of a step), with the estimator TCP uses for its retransmission timeout
# (RFC 6298): an exponential moving average of the peak and one of its absolute deviation,
#     dev  <- (1 - beta) * dev + beta * |p - mean|        (beta = dev_gain, 1/4)
#     mean <- (1 - alpha) * mean + alpha * p               (alpha = gain, 1/8)
# seeded with mean = p, dev = p / 8 after the first step. The *target* reservation is
#     target = mean + deviations * dev                     (deviations = 2)
# rounded up to whole pages (and capped by ``max_bytes``). So the headroom is not a fixed percentage:
# it is what the step-to-step variation of the workload needs, and it tends to 0 on a steady workload.
# The gains set how fast the target follows a drift (about 1 / gain steps) against how much one
# unusually large or small step moves it. ``deviations`` trades memory for growth events: a step that
# peaks above the reservation grows it mid-step (a small chunk, faulted in once), so a lower value
# holds less idle memory and allocates more often (``bench_pool_step_policy.py`` measures the curve,
# see benchmarks/results/pool_step_policy.json).
#   1. Mid-step growth (a store finds too few free pages) allocates max(shortfall, target - reserved,
#      min_step_bytes, g) bytes, where g is ``growth * reserved`` before any step was observed
#      (geometric growth: O(log) grow events in the first step) and ``deviations * dev`` after.
#   2. That amount is split into chunks of at most max(min_step_bytes, granule * target) bytes
#      (granule = 1/8), so the reservation can later be given back in steps of ~1/8 of the target:
#      chunks cannot be freed in part. Smaller chunks follow demand more closely but more records
#      straddle two chunks (two runs of pages: ``borrow`` must gather them); 1/8 balances the two.
#   3. At ``end_step``, only if the reservation exceeds target + slack with
#      slack = max(min_step_bytes, slack * target) (hysteresis: a busy step's growth is not given back
#      at once, or a workload that fluctuates around the target would allocate and free every few
#      steps), trailing chunks that are entirely free are freed while what remains is >= target.
#      Allocation takes pages from the lowest chunks first, so at a step boundary (everything
#      released) all trailing chunks are free.


@dataclass(frozen=True)
class AdaptiveGrowth:
    """Size the pool from an EMA of per-step peak usage plus a deviation-based headroom.

    See NOTE [ Adaptive growth rule ] in ``pool/growth.py``.
    """

    gain: float = 1 / 8
    dev_gain: float = 1 / 4
    deviations: float = 2.0
    growth: float = 0.5
    granule: float = 1 / 8
    slack: float = 1 / 16
    min_step_bytes: int = 1 * MIB

    def __post_init__(self) -> None:
        _check_fraction("AdaptiveGrowth.gain", self.gain, 1e-6, 1.0)
        _check_fraction("AdaptiveGrowth.dev_gain", self.dev_gain, 1e-6, 1.0)
        _check_fraction("AdaptiveGrowth.deviations", self.deviations, 0.0, 100.0)
        _check_fraction("AdaptiveGrowth.growth", self.growth, 0.0, 100.0)
        _check_fraction("AdaptiveGrowth.granule", self.granule, 1e-3, 1.0)
        _check_fraction("AdaptiveGrowth.slack", self.slack, 0.0, 100.0)
        _check_int("AdaptiveGrowth.min_step_bytes", self.min_step_bytes, 1)

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


# NOTE [ Tracking growth rule ]
# ``AdaptiveGrowth`` keeps mean + 2 * dev reserved between steps, so that a busy step seldom
# allocates; the price is idle memory at an ordinary step's peak (about 2 * dev of it).
# ``TrackingGrowth`` makes the opposite trade: the reservation follows the peak of the *current*
# step, and what a busy step added is given back at its end. With ``mean`` and ``dev`` the estimator
# of NOTE [ Adaptive growth rule ]:
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
# demand more records straddle two chunks (``borrow`` gathers those into its scratch buffer), which
# costs CPU time per step. ``deviations`` moves along that curve: a higher value maps more memory a
# step for a higher occupancy. The measured trade-off against ``AdaptiveGrowth`` (bytes mapped,
# grow / shrink events, CPU time and occupancy per step) is in
# benchmarks/results/pool_fragmentation.json and benchmarks/results/pool_step_policy.json. Use it
# where idle reserved memory costs more than that, e.g. when other allocations share the host's
# memory; with many records per step (a real network) the straddling share drops.


@dataclass(frozen=True)
class TrackingGrowth:
    """Keep a floor below the typical per-step peak and grow to each step's peak in small granules.

    See NOTE [ Tracking growth rule ] in ``pool/growth.py``. Trades grow / shrink events (and the page
    faults of re-mapping up to the peak every step) for a higher occupancy (pages in use / reserved)
    at each step's peak, where ``AdaptiveGrowth`` idles its headroom.
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
        _check_fraction("TrackingGrowth.gain", self.gain, 1e-6, 1.0)
        _check_fraction("TrackingGrowth.dev_gain", self.dev_gain, 1e-6, 1.0)
        _check_fraction("TrackingGrowth.deviations", self.deviations, 0.0, 100.0)
        _check_fraction("TrackingGrowth.granule", self.granule, 1e-4, 1.0)
        _check_fraction("TrackingGrowth.growth", self.growth, 0.0, 100.0)
        _check_int("TrackingGrowth.min_step_bytes", self.min_step_bytes, 1)

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
