"""The estimate of the logit error that rounding attention's q and k adds (``saved/attention_precision.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from daftrain.saved.attention_precision import (
    LOGIT_ERROR_LIMIT,
    AttentionPrecision,
    MaskStorage,
    logit_error,
    mask_error,
)


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
    precision = AttentionPrecision(8, 256)
    assert logit_error(*small, None, 8, 256) < LOGIT_ERROR_LIMIT < logit_error(*large, None, 8, 256)
    assert not precision.exact(0, 0, *small, None)
    assert precision.exact(0, 1, *large, None)
    # kept for later steps at the same position and shapes, made again for new shapes
    assert precision.exact(1, 1, *small, None)
    assert not precision.exact(1, 1, small[0][:, :, :16], small[1][:, :, :16], None)


def test_learned_masks_rounded_as_far_as_they_err_the_logits_little() -> None:
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 2, 32, 32, generator=gen)
    # rounding a mask errs each logit by its own rounding: a group's step over sqrt(6), ~range / 3 at 2 bits
    assert mask_error(0.05 * bias, 2, 256) < LOGIT_ERROR_LIMIT < mask_error(bias, 2, 256)
    assert mask_error(bias, 8, 256) < LOGIT_ERROR_LIMIT
    floor = bias.clone()
    floor[..., 16:] = torch.finfo(torch.float32).min  # a causal or padding floor added into the bias
    nan = bias.clone()
    nan[0, 0, 0, 0] = float("nan")
    precision = AttentionPrecision(8, 256)
    expected = [(0.05 * bias, MaskStorage.ROUNDED), (bias, MaskStorage.AT_MIN_BITS), (floor, MaskStorage.EXACT),
                (nan, MaskStorage.EXACT)]
    for index, (mask, storage) in enumerate(expected):
        assert precision.mask_storage(0, index, mask) is storage, index

