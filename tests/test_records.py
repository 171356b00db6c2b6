"""Records, and channel scaling (``NOTE [ Channel scaling ]`` in ``records.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import daftrain
from daftrain.importance import noise_profile
from daftrain.pool import PagePool, PoolConfig
from daftrain.records import (
    ExactRecord,
    PagedQuantizedRecord,
    QuantizedRecord,
    channel_exponents,
    encode,
    into_pool,
    scaling_channels,
)

G = 256


def outlier_activations(rows: int = 512, channels: int = 384, seed: int = 0) -> torch.Tensor:
    """Transformer-like hidden states: unit-scale values with a few channels 20-30x larger in every row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=gen)
    x[:, [7, 100, 250]] *= torch.tensor([30.0, 20.0, 25.0])
    return x


def test_scaling_channels_is_the_innermost_memory_dim():
    x = torch.randn(4, 32, 64)
    assert scaling_channels(x, dense=True) == 64
    assert scaling_channels(x.transpose(1, 2), dense=True) == 64  # a transposed view: memory order decides
    assert scaling_channels(x[:, :, :48], dense=False) == 48  # packed in logical order: its last dim
    assert scaling_channels(torch.randn(4096), dense=True) is None  # one dim: no channels
    assert scaling_channels(torch.randn(512, 8), dense=True) is None  # too few channels
    assert scaling_channels(torch.randn(1, 64), dense=True) is None  # a single row
    assert scaling_channels(torch.randn(8, 64).to(torch.int32), dense=True) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_channel_exponents_bound_each_channel_and_stay_representable(dtype):
    x = outlier_activations().to(dtype)
    x[:, 3] = 0.0
    x[:, 5] *= 1e-6
    e = channel_exponents(x.view(-1), 384)
    assert e.dtype == torch.int8 and e.shape == (384,)
    amax = x.float().abs().amax(0)
    scaled = (x.float() / torch.exp2(e.float())).abs().amax(0)
    assert bool((scaled < 1).all())
    # each channel's largest value reaches at least half of [-1, 1] unless its exponent was clamped
    low = {torch.float16: -14}.get(dtype, -126)
    unclamped = (amax > 0) & (e.float() > low)
    assert bool((scaled[unclamped] >= 0.5).all())
    assert int(e[3]) == 0  # an all-zero channel is left alone
    if dtype is torch.float16:
        assert int(e[5]) == low  # 2**-low must stay a normal float16
    x[0, 1] = math.inf
    assert channel_exponents(x.view(-1), 384) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_scaled_record_decodes_to_the_scaled_layout_times_the_exact_powers_of_two(bits, dtype):
    x = outlier_activations().to(dtype)
    flat = x.view(-1)
    record = encode(flat, "quantize", bits, G, seed=11, channels=384)
    assert isinstance(record, QuantizedRecord) and record.channel_exp is not None
    # the layout holds the scaled values; decoding multiplies back by exact powers of two
    factors = torch.exp2(record.channel_exp.float())
    scaled = (x.float() / factors).to(dtype).view(-1)
    codes, lo, scale = torch.ops.daftrain.quantize_pack(scaled, bits, G, 11)
    assert torch.equal(codes, record.codes) and torch.equal(lo, record.lo) and torch.equal(scale, record.scale)
    plain = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, G, flat.numel(), dtype)
    expected = (plain.view(-1, 384).float() * factors).to(dtype).view(-1)
    assert torch.equal(record.decode(), expected)
    assert record.nbytes == codes.nbytes + lo.nbytes + scale.nbytes + 384


def test_scaling_is_unbiased():
    # Stochastic rounding of the scaled values is unbiased and the powers of two are exact, so the
    # mean of many decodes converges to x: its error shrinks like 1/sqrt(draws). Allow 2x that.
    x = outlier_activations(rows=64).view(-1)
    draws = 400
    decodes = torch.stack([encode(x, "quantize", 2, G, seed=s, channels=384).decode() for s in range(draws)])
    single = (decodes[0] - x).norm()
    mean = (decodes.mean(0) - x).norm()
    assert mean < 2 * single / math.sqrt(draws), (mean, single)


def test_scaling_cuts_the_noise_that_outlier_channels_cause_and_the_profile_predicts_it():
    x = outlier_activations().view(-1)
    plain = torch.stack([(encode(x, "quantize", 2, G, seed=s).decode() - x).pow(2).sum() for s in range(20)])
    scaled = torch.stack([(encode(x, "quantize", 2, G, seed=s, channels=384).decode() - x).pow(2).sum()
                          for s in range(20)])
    # three outlier channels set every group's range without scaling; with it each channel has its own
    assert float(scaled.mean()) < float(plain.mean()) / 5
    # the allocation's noise model follows both: measured energy within 15% of the profile's
    # (20 draws of ~200k independent roundings each: the mean is far tighter than that)
    for measured, channels in ((plain, None), (scaled, 384)):
        predicted = noise_profile(x, G, channels).energy(2)
        assert abs(float(measured.mean()) / predicted - 1) < 0.15, (channels, float(measured.mean()), predicted)


@pytest.mark.parametrize(("rows", "channels", "group"), [(7, 384, 256), (33, 48, 256), (5, 96, 64)])
def test_scaled_noise_profile_weighs_each_group_by_its_channels(rows, channels, group):
    # ragged last groups and groups spanning rows: against the per-value sum, written out
    x = outlier_activations(rows=rows, channels=max(channels, 251))[:, :channels].contiguous().view(-1)
    e = channel_exponents(x, channels)
    values = (x.view(-1, channels) / torch.exp2(e.float())).view(-1)
    weight = torch.exp2(2.0 * e.double()).repeat(rows)
    pad = -x.numel() % group
    weight = torch.nn.functional.pad(weight, (0, pad)).view(-1, group).sum(1)
    padded = torch.nn.functional.pad(values.double(), (0, pad), value=float(values[-1])).view(-1, group)
    expected = float((weight * (padded.amax(1) - padded.amin(1)) ** 2).sum())
    got = noise_profile(x, group, channels)
    assert got.zero_r2 == 0.0 and got.plain_r2 == pytest.approx(expected, rel=1e-12)


def test_non_finite_scaled_tensor_is_kept_exact():
    x = outlier_activations()
    x[3, 5] = math.nan
    record = encode(x.view(-1), "quantize", 2, G, seed=0, channels=384)
    assert isinstance(record, ExactRecord) and record.reason == "nonfinite"


def test_pooled_and_demoted_scaled_records_keep_their_exponents():
    x = outlier_activations().view(-1)
    record = encode(x, "quantize", 4, G, seed=3, channels=384)
    pool = PagePool(PoolConfig(page_size=4096, budget_bytes=40 * 4096, spill=False))
    paged = into_pool(record, pool, importance=1.0, seed=3)  # 26 pages at 4 bits
    assert isinstance(paged, PagedQuantizedRecord)
    assert torch.equal(paged.decode(), record.decode())
    assert paged.nbytes == paged.pooled.nbytes + 384
    # a more important record does not fit beside it: the pool demotes it to 2 bits, re-quantizing the
    # scaled values, and decoding still multiplies them back by the record's powers of two
    other = into_pool(encode(x, "quantize", 4, G, seed=4, channels=384), pool, importance=2.0, seed=4)
    assert paged.pooled.demotions == 1 and other.pooled.demotions == 0
    with paged.pooled.borrow() as (codes, lo, scale):
        assert codes.shape[1] * 8 // G == 2
        scaled = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, 2, G, x.numel(), torch.float32)
    assert torch.equal(paged.decode(), (scaled.view(-1, 384) * torch.exp2(record.channel_exp.float())).view(-1))
    pool.close()


class OutlierBlock(nn.Module):
    """LayerNorm-free stand-in for a transformer block whose hidden states have outlier channels."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(384, 256), nn.Linear(256, 384)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(h)))


def test_channel_scaling_cuts_the_weight_gradient_error_of_outlier_inputs():
    torch.manual_seed(0)
    layer = nn.Linear(384, 64)
    h = outlier_activations(rows=256).requires_grad_()
    weights = torch.randn(256, 64)  # a linear loss: the output gradient is exact, the error is x_hat's alone

    def weight_grad(ctx):
        layer.zero_grad()
        with ctx:
            out = layer(h * 1.0)  # a computed input: its saved copy is packed
        (out * weights).sum().backward()
        return layer.weight.grad.clone()

    exact = weight_grad(daftrain.compress(bits=None))

    def error(scaled: bool) -> float:
        ctx = daftrain.compress(bits=2, seed=1, channel_scaling=scaled)
        return sum(float((weight_grad(ctx) - exact).pow(2).sum()) for _ in range(5))

    # dW = g^T x_hat: its error is the input's noise weighted by the output gradient, so scaling must
    # cut it by about what it cuts the input's noise (5x and more above)
    assert error(scaled=True) < error(scaled=False) / 4


def test_auto_bits_budget_counts_the_exponents_and_the_state_keeps_the_channels():
    torch.manual_seed(0)
    block = OutlierBlock()
    ctx = daftrain.compress(bits="auto", avg_bits=2.0, model=block, seed=2, channel_scaling=True)
    fixed = daftrain.compress(bits=2, seed=2, channel_scaling=True)
    for _ in range(2):
        with ctx:
            out = block(outlier_activations(rows=256).requires_grad_() * 1.0)
        out.square().mean().backward()
    report = ctx.report()
    assert {s.channels for s in report.slots} == {384, 256}
    assert {s["channels"] for s in report.to_dict()["slots"]} == {384, 256}
    assert report.used_bytes <= report.budget_bytes
    with ctx:
        block(outlier_activations(rows=256).requires_grad_() * 1.0)
    with fixed:
        block(outlier_activations(rows=256).requires_grad_() * 1.0)
    assert ctx.stats.stored_bytes <= fixed.stats.stored_bytes  # avg_bits=2 costs what fixed 2-bit does
    state = ctx.state_dict()
    assert {s["channels"] for s in state["slots"]} == {384, 256}
    other = daftrain.compress(bits="auto", avg_bits=2.0, model=block, seed=2)  # no channel scaling
    with pytest.raises(daftrain.StateDictError, match="channel_scaling"):
        other.load_state_dict(state)


def test_channel_scaling_packs_the_same_on_the_packer_thread():
    torch.manual_seed(0)
    layer = nn.Linear(384, 64)
    h = outlier_activations(rows=256).requires_grad_()

    def weight_grad(asynchronous: bool) -> torch.Tensor:
        layer.zero_grad()
        ctx = daftrain.compress(bits=2, seed=4, channel_scaling=True, asynchronous=asynchronous)
        with ctx:
            out = layer(h * 1.0)
        out.square().sum().backward()
        ctx.close()
        assert ctx.stats.compressed == 1
        return layer.weight.grad.clone()

    assert torch.equal(weight_grad(asynchronous=True), weight_grad(asynchronous=False))
