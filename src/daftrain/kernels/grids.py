"""Fitted grids: the quantization levels a tensor's values call for (``layout.py``)."""

from __future__ import annotations

import torch

from ..layout import GRID_BITS, check_grid
from . import ops as kernel_ops
from . import reference

__all__ = ["GRID_GAIN", "GRID_RESOLUTION", "fit_grid"]

GRID_GAIN = 0.95
"""A record takes a fitted grid only where it estimates at most this share of the uniform grid's rounding
variance: the fitted grid's kernels are slower, so it must buy a clear gain."""

GRID_RESOLUTION = 1 / 64
"""Fitted levels are multiples of this many steps, at least this far apart: exact in float32, with finite
reciprocal widths."""

_SAMPLE_GROUPS = 64
_BINS = 256
_LATTICE = 16
"""2-bit candidates: every pair of inner levels on multiples of 1 / _LATTICE steps."""
_BLENDS = (0.25, 0.5, 0.75, 1.0)
_DENSITY_POWERS = (1 / 3, 1 / 2)


# NOTE [ Fitted grids ]
# Stochastic rounding between two levels a < b adds the variance (t - a) * (b - t) to a value at t. On
# the uniform grid (levels every step from the group's min to its max) that is what every value pays
# wherever it lies; but the values of a group are not spread evenly over its range: a layer input is
# bell-shaped (most values near the middle, a few at the ends that set the range), a GELU output or a
# softmax probability is piled up at one end. Levels placed closer together where the values are, and
# further apart where few are, lower the variance at the same bytes, and the record stays unbiased: a
# value still goes to one of the two levels around it with the probabilities that keep its mean, and
# the extreme levels stay at the group's min and max. One grid per record, in units of each group's
# step, so it adapts to the shape of the record's distribution while each group keeps its own range.
#
# ``fit_grid`` histograms where the values of up to 64 groups fall inside their groups' ranges, and
# scores candidate grids by the variance that histogram would pay on them: at 2 bits every pair of inner
# levels on a lattice of 1/16 step (the exact optimum up to the lattice), at 4 bits level densities
# proportional to a power of the histogram's density (1/3 minimises a fine quantizer's mean squared
# error) blended with the uniform grid. The best is taken where it estimates at most ``GRID_GAIN`` of the
# uniform grid's variance. Zero-exact groups (ReLU outputs) keep the uniform grid (their zero is a level
# of its own), as do 1 and 8 bits. ``saved/grid_choice.py`` fits one grid per forward position.
#
# ``bits="auto"`` estimates each tensor's rounding noise on the uniform grid. Estimated on the grid each
# record gets, the tensors the grids help most looked cheapest to lower, but their gradient error falls
# less than their values' variance does (a fitted grid moves variance towards the tails, which backward
# may weigh more): the allocations came out worse against uniform bits at the same bytes (docs/auto.md).
def fit_grid(values: torch.Tensor, bits: int, group_size: int) -> torch.Tensor | None:
    """The fitted grid (float32 ``[2**bits]``, on ``values``' device) that estimates the least rounding
    variance for ``values`` quantized in groups of ``group_size``, or ``None`` where the uniform grid does
    about as well (``NOTE [ Fitted grids ]``)."""
    if bits not in GRID_BITS or not values.is_floating_point():
        return None
    values = values.detach()
    num_groups = values.numel() // group_size
    if num_groups == 0:
        return None
    levels = (1 << bits) - 1
    with torch.no_grad():
        picks = torch.linspace(0, num_groups - 1, min(num_groups, _SAMPLE_GROUPS), dtype=torch.float32,
                               device=values.device).round().long()
        # take: the sampled groups of ``values`` in row-major order, without a copy of a non-contiguous whole
        within = torch.arange(group_size, dtype=torch.int64, device=values.device)
        offsets = (picks[:, None] * group_size + within).reshape(-1)
        sample = values.take(offsets).view(-1, group_size).float()
        lo, scale = reference.group_params(kernel_ops.group_minmax(sample.reshape(-1), group_size), bits)
        step = scale.float().abs()
        plain = ~torch.signbit(scale) & torch.isfinite(lo) & torch.isfinite(step) & (step > 0)
        t = ((sample - lo[:, None]) / torch.where(plain, step, 1.0)[:, None])[plain]
        histogram = torch.histc(t.clamp(0, levels), _BINS, 0, levels).double()
        if not bool(histogram.sum() > 0):
            return None
        candidates = _candidates(histogram, bits).to(values.device)
        variance = _variance(histogram, candidates)
        best = int(variance.argmin())
        if not bool(variance[best] <= GRID_GAIN * variance[0]):
            return None
        grid = candidates[best].float().cpu()
    check_grid(grid, bits)
    return grid.to(values.device)


def _centers(levels: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(_BINS, dtype=torch.float64, device=device) + 0.5) * (levels / _BINS)


def _variance(histogram: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """The rounding variance each grid of ``grids`` [C, L + 1] pays on ``histogram``'s values (bin centres):
    over the centres ``c`` between levels ``a`` and ``b``, ``sum h (c - a)(b - c) = -S2 + (a + b) S1 - ab S0``
    with ``S_p = sum h c**p``, from prefix sums: O(C L), not O(C B)."""
    levels = grids.shape[1] - 1
    centers = _centers(levels, histogram.device)
    zero = histogram.new_zeros(1)
    s0, s1, s2 = (torch.cat([zero, (histogram * centers**p).cumsum(0)]) for p in (0, 1, 2))
    first = torch.searchsorted(centers, grids.contiguous())  # centres below each level
    first[:, 0], first[:, -1] = 0, centers.numel()
    below, above = grids[:, :-1], grids[:, 1:]

    def between(prefix: torch.Tensor) -> torch.Tensor:
        return prefix[first[:, 1:]] - prefix[first[:, :-1]]

    return (-between(s2) + (below + above) * between(s1) - below * above * between(s0)).sum(1)


def _snap(inner: torch.Tensor, levels: int) -> torch.Tensor:
    """Inner levels [C, L - 1] on multiples of ``GRID_RESOLUTION``, strictly ascending inside (0, L)."""
    count = inner.shape[1]
    position = torch.arange(count, dtype=inner.dtype, device=inner.device)
    ticks = torch.round(inner / GRID_RESOLUTION)
    ticks = torch.minimum(torch.maximum(ticks, position + 1), levels / GRID_RESOLUTION - count + position)
    for j in range(1, count):  # each at least one tick above the one below; the cap above leaves room
        ticks[:, j] = torch.maximum(ticks[:, j], ticks[:, j - 1] + 1)
    return ticks * GRID_RESOLUTION


def _candidates(histogram: torch.Tensor, bits: int) -> torch.Tensor:
    """Candidate grids [C, L + 1] (float64, on the CPU), the uniform grid first."""
    levels = (1 << bits) - 1
    uniform = torch.arange(levels + 1, dtype=torch.float64, device="cpu")
    inner: list[torch.Tensor] = []
    if bits == 2:
        ticks = torch.arange(1, levels * _LATTICE, dtype=torch.float64, device="cpu") / _LATTICE
        inner.append(torch.combinations(ticks, 2))
    density = histogram.cpu() / histogram.sum().cpu() + 1e-4 / _BINS
    edges = torch.linspace(0, levels, _BINS + 1, dtype=torch.float64, device="cpu")
    quantiles = torch.linspace(0, 1, levels + 1, dtype=torch.float64, device="cpu")[1:-1]
    for power in _DENSITY_POWERS:
        cumulative = torch.cat([torch.zeros(1, dtype=torch.float64, device="cpu"), (density ** power).cumsum(0)])
        cumulative = cumulative / cumulative[-1]
        j = torch.searchsorted(cumulative, quantiles).clamp(1, _BINS)
        c0, c1 = cumulative[j - 1], cumulative[j]
        companded = edges[j - 1] + (quantiles - c0) / (c1 - c0).clamp_min(1e-12) * (edges[j] - edges[j - 1])
        for blend in _BLENDS:
            inner.append((blend * companded + (1 - blend) * uniform[1:-1])[None])
    snapped = _snap(torch.cat(inner), levels)
    ends = torch.tensor([0.0, float(levels)], dtype=torch.float64, device="cpu").expand(snapped.shape[0], 2)
    grids = torch.cat([ends[:, :1], snapped, ends[:, 1:]], 1)
    return torch.cat([uniform[None], grids])
