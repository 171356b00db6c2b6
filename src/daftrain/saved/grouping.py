"""Which way a saved tensor's quantization groups run: along its rows (its memory order) or down its columns."""

from __future__ import annotations

import torch

from ..kernels import ops as kernel_ops
from .per_position import PerPosition
from .records import ByColumns, Derivative

__all__ = ["COLUMN_GAIN", "ColumnChoice", "by_columns_if_better"]

COLUMN_GAIN = 0.9
"""Groups run down the columns only where that estimates at most this share of the rounding variance of
groups along the rows: the column kernels' extra time must buy a clear gain."""


# NOTE [ Groups down the columns ]
# Stochastic rounding adds a variance of about ``range**2 / (6 * (2**bits - 1)**2)`` per value, with
# ``range`` the spread of the value's quantization group. Groups of ``group_size`` consecutive values in
# memory order run along the rows of a ``[tokens, features]`` activation: where ``features`` is smaller
# than a group, one group spans several tokens, and at any width it spans many features, so a feature
# whose values are large in every token (the outlier features of transformer activations) sets the range
# of every group it is in, and the small values beside it are rounded in its steps. Groups down a column
# hold one feature over ``group_size`` tokens instead. Which way gives the smaller ranges depends on the
# tensor, so both are measured, one min/max pass each: the rows' with ``group_minmax``, the columns' as
# a reduction over blocks of ``group_size`` rows, once per forward position (``ColumnChoice``). The
# column order is taken where it estimates at most ``COLUMN_GAIN`` of the rows' variance; the bytes are
# the same (the same number of groups of the same size: only tensors whose row count is a multiple of
# ``group_size`` are considered, so no group crosses a column), stored block by block of ``group_size``
# rows (``NOTE [ The stored order of groups down the columns ]`` in ``kernels/reference.py``). Both orders
# round stochastically, so the restored tensor is unbiased either way. An activation stored as its
# derivative (an elementwise encoding) is stored down the columns the same way, chosen on its input's ranges.
def by_columns_if_better(flat: torch.Tensor, source: torch.Tensor, group_size: int,
                         values: Derivative | None = None) -> ByColumns | None:
    """``ByColumns`` for ``flat`` (``source``'s values in memory order; what is stored of them: ``values``)
    where groups down the columns of ``source`` viewed as ``[rows, last dim]`` estimate clearly less
    rounding variance, else ``None``."""
    if source.dim() < 2 or not source.is_contiguous() or not source.is_floating_point():
        return None
    cols = source.shape[-1]
    if cols < 2 or flat.numel() % cols:
        return None
    rows = flat.numel() // cols
    if rows % group_size:
        return None
    with torch.no_grad():
        stats = kernel_ops.group_minmax(flat, group_size)
        along_rows = (stats[:, 1] - stats[:, 0]).double().square().sum()
        blocks = flat.view(rows // group_size, group_size, cols)
        down_columns = (blocks.amax(1) - blocks.amin(1)).double().square().sum()
        better = bool(down_columns <= COLUMN_GAIN * along_rows)
    return ByColumns(cols, group_size, values) if better else None


class ColumnChoice:
    """``by_columns_if_better`` per forward position (``PerPosition``: measured again when its tensor's shape,
    dtype or encoding changes, else every ``REESTIMATE_STEPS`` steps)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._made: PerPosition[ByColumns | None] = PerPosition()

    def layout(self, step: int, index: int, flat: torch.Tensor, source: torch.Tensor,
               values: Derivative | None) -> ByColumns | None:
        """The layout for the record at forward position ``index`` of ``step``."""
        what = (tuple(source.shape), source.dtype, source.is_contiguous(), values)
        return self._made.get(step, index, what, lambda: by_columns_if_better(flat, source, self.group_size, values))
