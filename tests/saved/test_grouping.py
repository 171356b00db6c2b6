"""Quantization groups down the columns (saved/grouping.py, records.ByColumns): when they are chosen, that
they restore the tensor in its own order, unbiased, and that they lower the gradient error at the same bytes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import daftrain
from daftrain.kernels import reference
from daftrain.kernels.grids import fit_grid
from daftrain.pool import PagePool, PoolConfig
from daftrain.saved import grouping, per_position
from daftrain.saved.grouping import by_columns_if_better
from daftrain.saved.records import (
    ByColumns,
    ByColumnsRecord,
    Derivative,
    ExactRecord,
    InMemory,
    PackedRecord,
    demote_payload,
)

G = 256


def outlier_features(rows: int = 512, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """``[tokens, features]`` with a few features 30x larger in every token, as transformer activations
    have: along the rows every group holds one, down the columns only their own groups are wide."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[:, :3] *= 30
    return x


def test_outlier_features_are_grouped_down_the_columns_and_outlier_rows_are_not() -> None:
    x = outlier_features()
    assert by_columns_if_better(x.view(-1), x, G) == ByColumns(64, G)
    rows = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    rows[::4] *= 30  # every fourth token large: down a column every group holds some
    assert by_columns_if_better(rows.view(-1), rows, G) is None


@pytest.mark.parametrize("shape", [(500, 64), (64,)])
def test_only_whole_column_groups_of_a_contiguous_tensor_are_considered(shape) -> None:
    x = torch.randn(shape)
    assert by_columns_if_better(x.reshape(-1), x, G) is None  # 500 rows: a group would cross a column
    t = outlier_features().t()  # not contiguous: its memory order is not its rows
    assert by_columns_if_better(t.contiguous().view(-1), t, G) is None


def test_the_record_restores_row_order_and_matches_the_reference_on_the_stored_order() -> None:
    x = outlier_features()
    record = ByColumns(64, G).encode(x.view(-1), 4, G, seed=7)
    assert isinstance(record, ByColumnsRecord)
    stored = x.view(2, G, 64).transpose(1, 2).reshape(-1)  # each block of G rows column after column
    codes, lo, scale = reference.quantize_pack(stored, 4, G, 7)
    decoded = reference.unpack_dequantize(codes, lo, scale, 4, G, x.numel(), torch.float32)
    expected = decoded.view(2, 64, G).transpose(1, 2).reshape(512, 64)
    assert torch.equal(record.decode().view(512, 64), expected)  # the same bytes, back in row order
    assert record.nbytes == codes.nbytes + lo.nbytes + scale.nbytes


def test_a_demoted_column_record_restores_its_demoted_codes_in_row_order() -> None:
    """A pool demotes a record by re-quantizing its payload in the stored order (``demote_payload``): the codes of
    a column record stay groups down the columns, now at half the bits on the uniform grid."""
    x = outlier_features()
    record = ByColumns(64, G).encode(x.view(-1), 4, G, seed=7, grids=lambda v, bits: fit_grid(v, bits, G))
    inner = record.inner
    assert inner.grid is not None  # the 4-bit grid must be dropped once the codes have 2 bits
    with inner.storage.borrow() as parts:
        demoted = demote_payload(parts, group_size=G, numel=inner.numel, seed=3, grid=inner.grid)
    paged = PackedRecord(InMemory(demoted), is_bool=False, numel=inner.numel, dtype=inner.dtype, group_size=G,
                         grid=inner.grid)
    stored = reference.unpack_dequantize(*demoted, 2, G, x.numel(), torch.float32)
    expected = stored.view(2, 64, G).transpose(1, 2).reshape(512, 64)
    assert torch.equal(ByColumnsRecord(paged, record.encoding, record.dtype).decode().view(512, 64), expected)


def test_non_finite_values_keep_the_tensor_exact() -> None:
    x = outlier_features()
    x[7, 9] = float("nan")
    record = ByColumns(64, G).encode(x.view(-1), 2, G, seed=1)
    assert isinstance(record, ExactRecord)
    assert torch.allclose(record.decode(), x.view(-1), rtol=0, atol=0, equal_nan=True)  # the values as saved


def test_column_groups_are_unbiased() -> None:
    x = outlier_features(seed=3).view(-1)
    enc = ByColumns(64, G)
    draws = torch.stack([enc.encode(x, 2, G, seed=s).decode() for s in range(400)])
    single = (draws[0] - x).norm()
    # an unbiased rounding's mean error shrinks like 1/sqrt(draws) (20x here); a bias would stay near single
    assert (draws.mean(0) - x).norm() < 2 * single / math.sqrt(400)


def _linear_grads(x0: torch.Tensor, ctx) -> torch.Tensor:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    lin = nn.Linear(x0.shape[1], 32)
    g = torch.randn(x0.shape[0], 32, generator=torch.Generator().manual_seed(5))
    x = x0.clone().requires_grad_()
    with ctx:
        y = lin(x * 1.0)
    y.backward(g)
    return lin.weight.grad


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_linear_inputs_gradient_error_falls_at_the_same_bytes(asynchronous: bool) -> None:
    x = outlier_features()
    ref = _linear_grads(x, daftrain.compress(bits=None))
    errors, stored = {}, {}
    for columns in (False, True):
        ctx = daftrain.compress(bits=2, min_numel=0, column_groups=columns, asynchronous=asynchronous)
        errors[columns] = sum(((_linear_grads(x, ctx) - ref).norm() / ref.norm()).item() for _ in range(4))
        stored[columns] = ctx.stats.stored_bytes
        ctx.close()
    assert stored[True] == stored[False]
    # Along the rows each group's range is an outlier feature's (~30x the rest): down the columns the 61
    # plain features round in their own steps. The weight gradient's error falls by more than half.
    assert errors[True] < 0.5 * errors[False], errors


def test_pooled_column_records_give_the_unpooled_gradients_and_return_their_pages() -> None:
    x = outlier_features()
    plain = _linear_grads(x, daftrain.compress(bits=2, min_numel=0, seed=4, column_groups=True))
    with PagePool(PoolConfig(page_size=16 << 10)) as pool:
        ctx = daftrain.compress(bits=2, min_numel=0, seed=4, pool=pool, column_groups=True)
        assert torch.equal(_linear_grads(x, ctx), plain)
        ctx.close()
        assert pool.stats().records == 0


def test_an_activation_stored_as_its_derivative_is_grouped_down_the_columns_too() -> None:
    x = outlier_features().view(-1)
    enc = ByColumns(64, G, Derivative("gelu"))
    record = enc.encode(x, 8, G, seed=2)
    assert isinstance(record, ByColumnsRecord)
    restored = record.decode()
    ones = torch.ones_like(x)
    # Backward reads only f'(x'): within 8-bit rounding of f'(x) (step ~1.26 / 255)
    got, want = torch.ops.aten.gelu_backward(ones, restored), torch.ops.aten.gelu_backward(ones, x)
    assert (got - want).abs().max() < 1.26 / 255


def test_bits_by_importance_observe_what_column_records_store() -> None:
    """``bits="auto"`` estimates a record's rounding noise from the groups it stores (``stored_as``): with
    column groups the estimate falls with the ranges, and the gradient is fixed 2-bit's at the same seed."""
    x = outlier_features()
    estimates = {}
    for columns in (False, True):
        ctx = daftrain.compress(bits="auto", avg_bits=2.0, min_numel=0, column_groups=columns, seed=3)
        for _ in range(2):  # an adaptation step, then the allocation in force
            got = _linear_grads(x, ctx)
        estimates[columns] = ctx.report().quant_variance
        ctx.close()
    # the outlier features' ranges leave the row groups' estimate several times the columns' (7x here)
    assert estimates[True] < 0.5 * estimates[False], estimates
    fixed = daftrain.compress(bits=2, min_numel=0, seed=3, column_groups=True)
    _linear_grads(x, fixed)  # the same step, so the same rounding seeds
    assert torch.equal(_linear_grads(x, fixed), got)


def test_a_positions_choice_is_measured_once_then_again_when_its_tensor_changes_or_steps_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = grouping.by_columns_if_better
    monkeypatch.setattr(grouping, "by_columns_if_better", lambda *a: calls.append(a[1].shape) or real(*a))
    choice, x = grouping.ColumnChoice(G), outlier_features()
    for step in range(3):
        assert choice.layout(step, 0, x.view(-1), x, None) == ByColumns(64, G)
    assert len(calls) == 1
    y = outlier_features(rows=256)
    assert choice.layout(3, 0, y.view(-1), y, None) == ByColumns(64, G)  # a new shape at that position
    assert choice.layout(3 + per_position.REESTIMATE_STEPS, 0, y.view(-1), y, None) == ByColumns(64, G)
    assert len(calls) == 3


def test_a_variance_target_calibrates_column_records_of_derivatives() -> None:
    """``error_share`` calibrates on the loss: an in-place SiLU's input (autograd's clone of it) stored as f'(x)
    down the columns is perturbed as f'(x) (what it stores), and the bound holds the gradient's cosine near
    1 - share / 2. (Out of place, the call saves f'(x) itself: ``NOTE [ Activations that save their derivative ]``.)"""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.SiLU(inplace=True), nn.Linear(128, 64))
    with torch.no_grad():
        net[0].weight[:3] *= 30  # three hidden features large in every token: the SiLU input's outliers
    x, encodings = torch.randn(512, 64, generator=torch.Generator().manual_seed(2)), []

    def grads(ctx) -> torch.Tensor:  # type: ignore[no-untyped-def]
        net.zero_grad(set_to_none=True)
        with ctx:
            loss = net(x * 1.0).pow(2).mean()  # the loss under the context: it calibrates on it
        if isinstance(ctx, daftrain.compress) and ctx.config.bits is not None:
            encodings[:] = list(ctx._record_encoding.values())  # the records live until backward
        loss.backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    ref = grads(daftrain.compress(bits=None))
    ctx = daftrain.compress(bits="auto", error_share=0.01, min_numel=0, column_groups=True)
    for _ in range(3):  # adaptation, calibration, the allocation in force
        got = grads(ctx)
    assert ByColumns(128, G, Derivative("silu")) in encodings
    assert torch.nn.functional.cosine_similarity(got, ref, dim=0) >= 0.99
    ctx.close()
