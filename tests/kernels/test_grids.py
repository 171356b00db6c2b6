"""Fitted grids (kernels/grids.py): which tensors take one, that it rounds with less variance on the kernels'
real rounding, and that a record on it is unbiased."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from daftrain.kernels import grids
from daftrain.kernels.grids import fit_grid

G = 256


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


SHAPES = {
    "bell": lambda: torch.randn(64, 1024, generator=_gen(0)),  # a layer input
    "gelu": lambda: nn.functional.gelu(torch.randn(64, 1024, generator=_gen(1))),  # piled up at one end
    "softmax": lambda: torch.softmax(torch.randn(64, 1024, generator=_gen(2)) * 3, -1),  # attention probabilities
}


def _squared_error(x: torch.Tensor, bits: int, grid: torch.Tensor | None, draws: int = 4) -> float:
    flat, total = x.reshape(-1), 0.0
    for seed in range(draws):
        codes, lo, scale = torch.ops.daftrain.quantize_pack(flat, bits, G, seed, grid)
        restored = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, G, flat.numel(), flat.dtype, grid)
        total += float((restored - flat).double().square().sum())
    return total / draws


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_fitted_grid_rounds_with_less_variance(shape: str, bits: int) -> None:
    x = SHAPES[shape]()
    grid = fit_grid(x, bits, G)
    assert grid is not None and grid.dtype == torch.float32 and grid.numel() == 1 << bits
    # The estimate picked it for at most GRID_GAIN of the uniform grid's variance; the kernels' real
    # rounding (4 draws of 65536 values: a relative noise below 1 %) must show a gain of that order.
    assert _squared_error(x, bits, grid) <= (grids.GRID_GAIN + 0.02) * _squared_error(x, bits, None)


def test_evenly_spread_values_and_relu_outputs_keep_the_uniform_grid() -> None:
    assert fit_grid(torch.rand(64, 1024, generator=_gen(3)), 2, G) is None  # uniform is already best
    relu = torch.relu(torch.randn(64, 1024, generator=_gen(4)))
    assert fit_grid(relu, 2, G) is None  # every group zero-exact: its zero is a level of its own
    x = torch.randn(64, 1024, generator=_gen(5))
    assert fit_grid(x, 1, G) is None and fit_grid(x, 8, G) is None
    assert fit_grid(x[:1, :100], 2, G) is None  # not one whole group


class _LargestAllocation(TorchDispatchMode):
    """The most bytes any op allocated (views of ``source`` not counted)."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self.source, self.nbytes = source.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.source:
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("view", ["transposed", "expanded"])
def test_a_grid_is_fitted_on_a_view_without_copying_it(view: str) -> None:
    # Column groups fit their grid on a transposed view (``grouping.py``): the sampled groups are read in the
    # view's row-major order, the same grid as of its contiguous copy, and no op allocates more than the sample.
    base = nn.functional.gelu(torch.randn(512, 1024, generator=_gen(7)))
    values = base.t() if view == "transposed" else base[:1].expand(512, 1024)
    assert not values.is_contiguous()
    with _LargestAllocation(base) as largest:
        grid = fit_grid(values, 2, G)
    expected = fit_grid(values.contiguous(), 2, G)
    assert grid is not None and expected is not None and torch.equal(grid, expected)
    assert largest.nbytes <= grids._SAMPLE_GROUPS * G * 8  # the sample's offsets (int64)


@pytest.mark.parametrize("bits", [2, 4])
def test_a_record_on_a_fitted_grid_is_unbiased(bits: int) -> None:
    x = nn.functional.gelu(torch.randn(8 * G, generator=_gen(6)) * 2)
    grid = fit_grid(x, bits, G)
    assert grid is not None
    draws = 400
    total, sq = torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64)
    for seed in range(draws):
        codes, lo, scale = torch.ops.daftrain.quantize_pack(x, bits, G, seed, grid)
        error = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, G, x.numel(), x.dtype, grid) - x
        total += error
        sq += error.double().square()
    mean, sd = total / draws, (sq / draws - (total / draws).square()).clamp_min(0).sqrt()
    # Each value's mean error over 400 independent draws is within 5 standard errors of 0 (a biased
    # rounding, e.g. onto the wrong pair of levels, is off by a share of the gap on most values).
    z = (mean.abs() / (sd / draws**0.5).clamp_min(1e-12))[sd > 0]
    assert float(z.max()) < 5.5 and float(z.square().mean()) < 1.3
