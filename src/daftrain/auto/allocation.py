"""Bit allocation: each saved tensor's bit-width under a byte budget, minimising estimated variance.

Every tensor ``i`` (a *slot*, see ``NOTE [ Slots ]`` in ``report.py``) has a few choices
``(bits, bytes, variance)``: bits 1, 2, 4, 8 in the unified layout, or kept exact. The solver picks one
choice per tensor to minimise ``sum_i variance_i`` subject to ``sum_i bytes_i <= budget``. Bytes are
those of the real layout (``layout.py``: per group ``bits * G / 8`` bytes of codes + float32 lo +
bfloat16 scale); see ``NOTE [ Greedy allocation and when it is optimal ]`` at ``solve``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..layout import SUPPORTED_BITS, PackedLayout

__all__ = ["MEASURED_BITS", "AllocationError", "Choice", "NoiseProfile", "Solution", "budget_for_avg_bits",
           "choices_for", "solve", "solve_for_variance"]

_LO_SCALE_BYTES = 4 + 2  # float32 lo + bfloat16 scale per group (layout.py)


class AllocationError(InvalidArgumentError):
    """A budget that no assignment of bits can meet."""


@dataclass(frozen=True)
class Choice:
    """One way to store a tensor: ``bits`` (``None`` = exact), its bytes and its estimated variance."""

    bits: int | None
    nbytes: int
    variance: float


MEASURED_BITS: tuple[int, ...] = (1, 2, 4)
"""Widths at which the rounding noise of plain groups is measured (``NOTE [ Measured rounding noise ]``)."""


# NOTE [ Measured rounding noise ]
# Stochastic rounding onto a grid of step ``d`` adds ``frac * (1 - frac) * d**2`` to a value, ``frac``
# its position inside its step. The analytic energy averages that over a uniform ``frac`` (``d**2 / 6``),
# which holds where values are spread evenly across each step, as at 4 bits and more. At 1 and 2 bits a
# step spans much of a group's range and the values' distribution decides: bell-shaped groups sit
# mid-step at 1 bit (more noise than the average says), GELU outputs crowd one end of their range
# (less; docs/auto.md has the ratios). The allocation trades exactly these widths against each other
# (a tensor at 1 bit against another at 4), so an adaptation step measures the plain groups' energy at
# ``MEASURED_BITS`` from the values themselves (``observe`` in ``tracing.py``: on evenly spaced groups,
# its ratio to their analytic energy applied to the whole tensor; on adaptation steps only); other
# widths and zero-exact groups keep the analytic energy.
@dataclass(frozen=True)
class NoiseProfile:
    """Sums of squared group ranges of one tensor, from which its rounding noise at any bit-width follows.

    ``plain_r2`` sums ``n_g * (max_g - min_g)**2`` over groups quantized in plain mode, ``zero_r2`` sums
    ``n_g * (max_g - min_positive_g)**2`` over zero-exact groups (min exactly 0, as after a ReLU);
    ``n_g`` is the group's number of values. ``plain_measured``, where given, is the plain groups'
    expected squared error at each width of ``MEASURED_BITS``, measured from the values
    (``NOTE [ Measured rounding noise ]``).
    """

    plain_r2: float
    zero_r2: float
    plain_measured: tuple[float, ...] = ()

    def energy(self, bits: int | None) -> float:
        """Expected squared error ``E ||x_hat - x||^2`` of the tensor stored at ``bits`` (the plain groups'
        measured energy where there is one).

        Stochastic rounding onto a grid of step ``d`` adds a variance ``frac * (1 - frac) * d**2`` per
        value, ``d**2 / 6`` on average over the position inside a step. Plain groups have ``2**b - 1``
        steps over their range; zero-exact groups spend code 0 on the value 0 and have ``2**b - 2`` steps
        over their positive range, or at 1 bit one level at its midpoint (error ``r**2 / 12`` on average).
        """
        if bits is None:
            return 0.0
        if self.plain_measured and bits in MEASURED_BITS:
            plain = self.plain_measured[MEASURED_BITS.index(bits)]
        else:
            plain = self.plain_r2 / (6.0 * ((1 << bits) - 1) ** 2)
        zero = self.zero_r2 / 12.0 if bits == 1 else self.zero_r2 / (6.0 * ((1 << bits) - 2) ** 2)
        return plain + zero


def packed_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of a ``numel``-value record at ``bits`` in the unified layout."""
    return PackedLayout(bits, group_size, numel).nbytes


def budget_for_avg_bits(numels: Sequence[int], avg_bits: float, group_size: int) -> int:
    """The byte budget that ``avg_bits`` per value means over tensors of ``numels`` values.

    Counted like the layout, per group ``avg_bits * G / 8`` bytes of codes plus the fixed lo and scale,
    so an integer ``avg_bits`` is exactly the bytes of that fixed bit-width.
    """
    total = 0.0
    for numel in numels:
        groups = math.ceil(numel / group_size)
        total += groups * (avg_bits * group_size / 8 + _LO_SCALE_BYTES)
    return math.floor(total + 1e-6)


def choices_for(numel: int, itemsize: int, group_size: int, noise: NoiseProfile, sensitivity: float,
                allow_exact: bool = True, min_bits: int = 1) -> tuple[Choice, ...]:
    """The choices of one tensor: every supported bit-width from ``min_bits``, then exact;
    variance = sensitivity x energy."""
    out = [Choice(b, packed_nbytes(numel, b, group_size), sensitivity * noise.energy(b))
           for b in SUPPORTED_BITS if b >= min_bits]
    if allow_exact:
        out.append(Choice(None, numel * itemsize, 0.0))
    return tuple(out)


def lower_hull(choices: Sequence[Choice]) -> list[int]:
    """Indices of the choices on the lower convex hull of (bytes, variance), cheapest first.

    Dominated choices (no fewer bytes and no less variance than another) are dropped, and so are the
    ones above the hull; the slopes of the result strictly increase (become less negative).
    """
    order = sorted(range(len(choices)), key=lambda i: (choices[i].nbytes, choices[i].variance, i))
    frontier: list[int] = []
    for i in order:  # Pareto frontier: bytes increasing, variance strictly decreasing
        if not frontier or choices[i].variance < choices[frontier[-1]].variance:
            if frontier and choices[i].nbytes == choices[frontier[-1]].nbytes:
                frontier.pop()
            frontier.append(i)
    hull: list[int] = []
    for i in frontier:
        while len(hull) >= 2 and _not_convex(choices[hull[-2]], choices[hull[-1]], choices[i]):
            hull.pop()
        hull.append(i)
    return hull


def _not_convex(a: Choice, b: Choice, c: Choice) -> bool:
    # b lies on or above the segment a-c: cross product of (b - a) and (c - a) is <= 0.
    cross = (b.nbytes - a.nbytes) * (c.variance - a.variance) - (b.variance - a.variance) * (c.nbytes - a.nbytes)
    return cross <= 0


@dataclass(frozen=True)
class Solution:
    """The solver's answer: one choice index per tensor, and what it costs."""

    picks: tuple[int, ...]
    nbytes: int
    variance: float
    budget: int
    skipped_gain: float
    """Variance reduction of the first upgrade that did not fit (0 if none): the most by which the
    answer can exceed the optimum, see ``NOTE [ Greedy allocation and when it is optimal ]``."""


# NOTE [ Greedy allocation and when it is optimal ]
# The problem is a multiple-choice knapsack. The solver is the classic marginal-gain greedy over
# each tensor's *lower convex hull* of (bytes, variance) points:
#   1. per tensor, drop dominated choices and those above the hull (they are never the best at any
#      price per byte); the hull's slopes then decrease in magnitude, i.e. diminishing returns;
#   2. start every tensor at its cheapest choice, then repeatedly take the upgrade (next hull point of
#      one tensor) with the largest variance reduction per byte, from a heap; an upgrade that does not
#      fit the remaining bytes ends that tensor's upgrades (its later hull points cost even more);
#      ties break on the tensor's index, so the result is deterministic.
# Claim (exact optimality at breakpoints). Until the first upgrade that does not fit, every tensor sits
# at the hull point that minimises ``variance + lam * bytes`` for the last accepted price ``lam`` (hull
# convexity). Summing over tensors, no assignment of *any* choices (hull or not) with at most the same
# total bytes has a smaller total variance. So when the greedy uses the budget exactly, or stops only
# because the heap is empty, its answer is optimal.
# Claim (not optimal in general). When an upgrade does not fit, the greedy skips it and keeps adding
# smaller upgrades; the result can then be beaten. Example, budget slack 11 bytes: A's upgrade costs 10
# bytes for -100 (10 per byte), B's 9 for -85, C's 2 for -19.9; the greedy takes A (-100) and stops,
# while B + C gives -104.9. The loss is bounded: the greedy objective is at most the optimum plus the
# variance reduction of the first upgrade it had to skip (the solution before that skip is optimal for
# its own bytes, and the optimum for the full budget is at most one fractional upgrade better, by the
# LP relaxation). For activation tensors each upgrade is a small share of the total, so the gap is
# small; ``tests/auto/test_allocation.py`` checks both claims against brute force.
def solve(items: Sequence[Sequence[Choice]], budget: int) -> Solution:
    """Pick one choice per item minimising total variance with total bytes <= ``budget``.

    Raises:
        AllocationError: when even the cheapest choice of every item exceeds ``budget``.
    """
    hulls = [lower_hull(c) for c in items]
    used = sum(c[h[0]].nbytes for c, h in zip(items, hulls, strict=True))
    if used > budget:
        raise AllocationError(
            f"the budget of {budget} bytes is below the {used} bytes the saved tensors take at their fewest "
            f"bits ({len(items)} tensors); raise avg_bits/packed_bytes or save fewer activations "
            "(e.g. with torch.utils.checkpoint)"
        )
    return _greedy(items, hulls, budget, -math.inf)


# NOTE [ Fewest bytes under a variance bound ]
# ``solve_for_variance`` is the same greedy walk as ``solve`` with the other constraint: it takes the
# upgrades in order of variance removed per byte, with no byte limit, and stops at the first point whose
# total variance is at most the bound. Every point of that walk is optimal for its own bytes (the first
# claim of ``NOTE [ Greedy allocation and when it is optimal ]``, which holds until an upgrade is
# skipped, and none is here), so no assignment with fewer bytes than the walk's previous point meets
# the bound: the answer costs at most one upgrade more than the optimum.
def solve_for_variance(items: Sequence[Sequence[Choice]], max_variance: float) -> Solution:
    """Pick one choice per item with total variance <= ``max_variance`` and the fewest bytes the greedy
    walk finds; see ``NOTE [ Fewest bytes under a variance bound ]``. Items whose every choice keeps
    some variance may leave the bound unmet: the answer is then every item at its least variance."""
    if not (max_variance >= 0):
        raise InvalidArgumentError(f"max_variance must be a non-negative number, got {max_variance!r}")
    hulls = [lower_hull(c) for c in items]
    return _greedy(items, hulls, math.inf, max_variance)


def _greedy(items: Sequence[Sequence[Choice]], hulls: list[list[int]], budget: float,
            max_variance: float) -> Solution:
    """The marginal-gain walk from every item's cheapest hull point: upgrades that fit ``budget``, until
    the total variance is at most ``max_variance`` (``-inf``: as far as the budget goes)."""
    pos = [0] * len(items)

    def current() -> float:
        return math.fsum(items[k][h[p]].variance for k, (h, p) in enumerate(zip(hulls, pos, strict=True)))

    used = sum(c[h[0]].nbytes for c, h in zip(items, hulls, strict=True))
    total = current()
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        h = hulls[i]
        if pos[i] + 1 < len(h):
            a, b = items[i][h[pos[i]]], items[i][h[pos[i] + 1]]
            heapq.heappush(heap, (-(a.variance - b.variance) / (b.nbytes - a.nbytes), i))

    for i in range(len(items)):
        push(i)
    skipped_gain = 0.0
    while heap:
        if total <= max_variance:  # check on the exact sum before stopping
            total = current()
            if total <= max_variance:
                break
        _, i = heapq.heappop(heap)
        a, b = items[i][hulls[i][pos[i]]], items[i][hulls[i][pos[i] + 1]]
        if used + b.nbytes - a.nbytes > budget:
            if skipped_gain == 0.0:
                skipped_gain = a.variance - b.variance
            continue
        used += b.nbytes - a.nbytes
        pos[i] += 1
        gain = a.variance - b.variance
        if gain >= total / 2:  # most of the sum goes: subtracting would leave its rounding error, re-add
            total = current()
        else:
            total -= gain
        push(i)
    picks = tuple(h[p] for h, p in zip(hulls, pos, strict=True))
    variance = math.fsum(c[p].variance for c, p in zip(items, picks, strict=True))
    return Solution(picks, used, variance, int(budget) if math.isfinite(budget) else used, skipped_gain)
