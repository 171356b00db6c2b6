"""Which grid each record's codes are on: ``fit_grid`` (``kernels/grids.py``) once per forward position."""

from __future__ import annotations

import torch

from ..kernels.grids import fit_grid
from .per_position import PerPosition

__all__ = ["GridChoice"]


class GridChoice:
    """``fit_grid`` per forward position (``PerPosition``: fitted again when what it stores changes shape,
    dtype or bits, else every ``REESTIMATE_STEPS`` steps)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._made: PerPosition[torch.Tensor | None] = PerPosition()

    def grid(self, step: int, index: int, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        """The grid of the record at forward position ``index`` of ``step``, which quantizes ``values``."""
        what = (tuple(values.shape), values.dtype, values.device, bits)
        return self._made.get(step, index, what, lambda: self._fit(values, bits))

    def _fit(self, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        return fit_grid(values, bits, self.group_size)
