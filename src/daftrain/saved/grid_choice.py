"""Which grid each record's codes are on: ``fit_grid`` (``kernels/grids.py``) once per forward position."""

from __future__ import annotations

import torch

from ..kernels.grids import fit_grid
from .per_position import PerPosition

__all__ = ["GridChoice"]


# NOTE [ Fitted grids on the CPU take float32 ]
# The numba kernels round onto a fitted grid in explicit float32 vectors (``NOTE [ Grid kernels without
# gathers ]`` in ``kernels/cpu.py``); float16 and bfloat16 inputs take the scalar loop, where the grid's
# per-level selects made a 4-bit encode several times slower than the uniform grid's. So on the CPU only
# float32 values get a fitted grid: what the op rules store (normalised values, derivatives) is float32
# whatever the model's dtype, and a bfloat16 activation under autocast keeps the uniform grid. The Triton
# kernels take every dtype in the same vectors.
def _fast_on_a_grid(values: torch.Tensor) -> bool:
    return values.dtype == torch.float32 or values.device.type != "cpu"


class GridChoice:
    """``fit_grid`` per forward position (``PerPosition``: fitted again when what it stores changes shape,
    dtype or bits, else every ``REESTIMATE_STEPS`` steps); float32 values only on the CPU
    (``NOTE [ Fitted grids on the CPU take float32 ]``)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._made: PerPosition[torch.Tensor | None] = PerPosition()

    def grid(self, step: int, index: int, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        """The grid of the record at forward position ``index`` of ``step``, which quantizes ``values``."""
        what = (tuple(values.shape), values.dtype, values.device, bits)
        return self._made.get(step, index, what, lambda: self._fit(values, bits))

    def _fit(self, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        return fit_grid(values, bits, self.group_size) if _fast_on_a_grid(values) else None
