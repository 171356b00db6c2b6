"""Fitted grids in ``compress`` (saved/grid_choice.py): one per forward position, fitted again when due, through
the pool's demotion, and a lower gradient error end to end at the same bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import daftrain
from daftrain.kernels.grids import fit_grid
from daftrain.saved import per_position
from daftrain.saved.grid_choice import GridChoice
from daftrain.saved.records import InMemory, PackedRecord, demote_payload, encode

G = 256


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_choice_is_kept_per_position_and_fitted_again() -> None:
    choice = GridChoice(G)
    x = torch.randn(64, 1024, generator=_gen(7))
    first = choice.grid(0, 3, x, 2)
    assert first is not None and choice.grid(1, 3, x * 5, 2) is first  # kept: same shape, dtype and bits
    assert choice.grid(1, 3, x[:32], 2) is not first  # its tensor changed shape
    again = choice.grid(1 + per_position.REESTIMATE_STEPS, 3, torch.rand(32, 1024, generator=_gen(8)), 2)
    assert again is None  # fitted again after REESTIMATE_STEPS: evenly spread values now


def test_a_steady_step_fits_no_grid(monkeypatch) -> None:
    # a position whose fit found no better grid (None) keeps that too: a steady step fits nothing (each fit
    # reads values back to the host, a wait for the device on a GPU)
    from daftrain.saved import grid_choice

    fits: list[bool] = []

    def counting(values, bits, group_size):  # type: ignore[no-untyped-def]
        grid = fit_grid(values, bits, group_size)
        fits.append(grid is not None)
        return grid

    monkeypatch.setattr(grid_choice, "fit_grid", counting)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    x = torch.randn(64, 256, generator=_gen(3))
    ctx = daftrain.compress(bits=2, min_numel=0)
    for step in range(3):
        fits.clear()
        with ctx:
            loss = model(x).square().mean()
        loss.backward()
        if step == 0:
            assert True in fits and False in fits, fits  # some positions fitted a grid, some kept the uniform one
        else:
            assert fits == []


def test_demotion_decodes_on_the_grid_then_rounds_on_the_uniform_grid() -> None:
    x = torch.randn(16 * G, generator=_gen(9))
    record = encode(x, "quantize", 4, G, 11, grids=lambda v, bits: fit_grid(v, bits, G))
    assert isinstance(record, PackedRecord) and record.grid is not None
    with record.storage.borrow() as parts:
        demoted = demote_payload(parts, group_size=G, numel=x.numel(), seed=5, grid=record.grid)
    assert demoted is not None and demoted[0].shape[1] == G * 2 // 8
    expected = torch.ops.daftrain.quantize_pack(record.decode(), 2, G, 5 ^ (0x9E3779B9 * 4))
    assert all(torch.equal(a, b) for a, b in zip(demoted, expected, strict=True))
    # The demoted payload under the record's (4-bit) grid decodes on the uniform grid, as it was made.
    demoted_record = PackedRecord(InMemory(demoted), is_bool=False, numel=x.numel(), dtype=x.dtype, group_size=G,
                                  grid=record.grid)
    plain = torch.ops.daftrain.unpack_dequantize(*demoted, 2, G, x.numel(), x.dtype)
    assert torch.equal(demoted_record.decode(), plain)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def _weight_grad(model: nn.Module, x: torch.Tensor, ctx: daftrain.compress | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x).square().mean()
    else:
        with ctx:
            loss = model(x).square().mean()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fitted_grids_lower_the_gradient_error_at_the_same_bytes(dtype: torch.dtype) -> None:
    model, x = _mlp().to(dtype), torch.randn(1024, 64, generator=_gen(10)).to(dtype)
    exact = _weight_grad(model, x, None).float()
    errors, sizes = {}, {}
    for fitted in (True, False):
        total = 0.0
        for seed in range(6):
            ctx = daftrain.compress(bits=2, seed=seed, fitted_grids=fitted)
            total += float((_weight_grad(model, x, ctx).float() - exact).square().sum())
        errors[fitted], sizes[fitted] = total, ctx.stats.packed_bytes
        assert (ctx.stats.fitted_grids > 0) is fitted  # every dtype gets a grid, on every device
    assert sizes[True] == sizes[False]  # the grid is the context's, not the records' bytes
    # Over 6 seeds the squared error is averaged enough that a 10 % gain is not noise (the per-tensor
    # estimates gain 15-45 % on these bell-shaped, GELU and tanh outputs).
    assert errors[True] < 0.9 * errors[False], errors


def test_stats_count_the_records_on_fitted_grids() -> None:
    model, x = _mlp(), torch.randn(1024, 64, generator=_gen(12))
    fitted, uniform = daftrain.compress(bits=2), daftrain.compress(bits=2, fitted_grids=False)
    for ctx in (fitted, uniform):
        _weight_grad(model, x, ctx)
    assert 0 < fitted.stats.fitted_grids <= fitted.stats.compressed and uniform.stats.fitted_grids == 0
    assert f"({fitted.stats.fitted_grids} on fitted grids)" in fitted.stats.summary()
