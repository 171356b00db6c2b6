"""Which grid each record's codes are on: ``fit_grid`` (``kernels/grids.py``) once per forward position."""

from __future__ import annotations

import torch

from ..kernels.grids import fit_grid
from .grouping import REESTIMATE_STEPS

__all__ = ["GridChoice"]


class GridChoice:
    """``fit_grid`` per forward position, fitted on a position's first step and again every
    ``REESTIMATE_STEPS`` steps or when what it stores changes shape, dtype or bits (one context's state)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._made: dict[int, tuple[tuple[object, ...], int, torch.Tensor | None]] = {}

    def grid(self, step: int, index: int, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        """The grid of the record at forward position ``index`` of ``step``, which quantizes ``values``."""
        what = (tuple(values.shape), values.dtype, values.device, bits)
        made = self._made.get(index)
        if made is not None and made[0] == what and step - made[1] < REESTIMATE_STEPS:
            return made[2]
        grid = fit_grid(values, bits, self.group_size)
        self._made[index] = (what, step, grid)
        return grid
