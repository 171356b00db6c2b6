"""The estimate of the logit error that rounding attention's q and k adds (``saved/attention_precision.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from daftrain.saved.attention_precision import LOGIT_ERROR_LIMIT, AttentionPrecision, Precision, logit_error


def _rounded(x: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """``x`` through the library's own 8-bit encode and decode (uniform grid, groups of 256 in memory order)."""
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x.contiguous(), bits, 256, seed)
    return torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, 256, x.numel(), x.dtype).view(x.shape)


@pytest.mark.parametrize(("d", "scale", "gain"), [(16, None, 1.0), (64, None, 3.0), (256, 1.0, 1.0)])
def test_estimate_matches_the_rounding_it_predicts(d: int, scale: float | None, gain: float) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = (gain * torch.randn(2, 4, 128, d, generator=gen) for _ in range(2))
    s = 1 / math.sqrt(d) if scale is None else scale
    exact = s * q @ k.transpose(-1, -2)
    errors = []
    for seed in range(4):
        rounded = s * _rounded(q, 8, 2 * seed) @ _rounded(k, 8, 2 * seed + 1).transpose(-1, -2)
        errors.append(float((rounded - exact).pow(2).mean().sqrt()))
    measured = sum(errors) / len(errors)
    estimated = logit_error(q, k, scale, 8, 256)
    # groups of 256 values in q's rows, each row's range whole: equal ranges here, so within draws' spread
    assert 0.8 * measured <= estimated <= 1.25 * measured, (estimated, measured)


def test_estimate_grows_with_the_logits_and_shrinks_with_the_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 64, 32, generator=gen) for _ in range(2))
    small, large = logit_error(q, k, None, 8, 256), logit_error(4 * q, 4 * k, None, 8, 256)
    assert large == pytest.approx(16 * small, rel=1e-4)  # both factors scale the logits and their error
    assert logit_error(q, k, None, 4, 256) == pytest.approx(small * 255 / 15, rel=1e-4)


def test_transposed_and_grouped_query_operands() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 64, 8, 16, generator=gen).transpose(1, 2)  # [b, h, t, d] as a view of [b, t, h, d]
    k = torch.randn(2, 64, 2, 16, generator=gen).transpose(1, 2)  # two key heads shared by eight query heads
    assert logit_error(q, k, None, 8, 256) == pytest.approx(logit_error(q.contiguous(), k.contiguous(), None, 8, 256))


def test_precision_per_position_and_shape() -> None:
    gen = torch.Generator().manual_seed(3)
    small = [torch.randn(1, 2, 32, 16, generator=gen) for _ in range(2)]
    large = [8 * t for t in small]
    precision = AttentionPrecision(8, 8, 256)
    assert logit_error(*small, None, 8, 256) < LOGIT_ERROR_LIMIT < logit_error(*large, None, 8, 256)
    assert precision.of(0, 0, *small, None) is Precision.QK
    assert precision.of(0, 1, *large, None) is Precision.EXACT
    # kept for later steps at the same position and shapes, made again for new shapes
    assert precision.of(1, 1, *small, None) is Precision.EXACT
    assert precision.of(1, 1, small[0][:, :, :16], small[1][:, :, :16], None) is Precision.QK


def test_copies_at_eight_bits_where_the_model_bits_would_err_the_logits() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k = (0.4 * torch.randn(1, 2, 32, 16, generator=gen) for _ in range(2))
    at = {bits: logit_error(q, k, None, bits, 256) for bits in (8, 4, 2)}
    assert at[8] < at[4] < LOGIT_ERROR_LIMIT < at[2], at
    assert AttentionPrecision(8, 4, 256).of(0, 0, q, k, None) is Precision.QK
    assert AttentionPrecision(8, 2, 256).of(0, 0, q, k, None) is Precision.QK_AND_COPIES
    assert AttentionPrecision(8, 8, 256).of(0, 0, q, k, None) is Precision.QK  # 8 bits: nothing to raise
    # where 8 bits already err too much, everything is kept exact whatever the model's bits
    assert AttentionPrecision(8, 2, 256).of(0, 0, 8 * q, 8 * k, None) is Precision.EXACT
