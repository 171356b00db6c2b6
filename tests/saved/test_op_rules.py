"""Each op rule of ``saved/op_rules.py`` against the plain quantization it replaces."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import daftrain
from daftrain.saved import attention_precision
from daftrain.saved.op_rules import RULES, ExactSavings, OpTracer, may_have_wide_head
from daftrain.saved.records import _INVERSE_POINTS, _LOOKUP_ELEMENTS, Derivative, _inverse_table


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.reshape(-1).double(), b.reshape(-1).double(), dim=0))


def _ctx(bits: int | None, rules: bool = True, **kwargs: object) -> daftrain.compress:
    ctx = daftrain.compress(bits=bits, min_numel=0, seed=3, **kwargs)
    if not rules:
        ctx._op_tracer = OpTracer(rules=())  # the hooks as they were before the op rules
    return ctx


def _grads(fn, inputs: list[torch.Tensor], ctx: daftrain.compress | None) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(0)
    if ctx is None:
        out = fn(*leaves)
    else:
        with ctx:
            out = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    return [x.grad for x in leaves]


def test_every_rule_has_a_reason_and_functions() -> None:
    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    for rule in RULES:
        assert len(rule.reason) > 40 and rule.functions, rule.name


def _mixed_rows() -> torch.Tensor:
    """Rows of tiny spread around an offset next to rows of unit spread, sharing quantization groups."""
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    x[::2] = 3.0 + 1e-3 * x[::2]
    return x


def test_layer_norm_input_error_is_not_amplified() -> None:
    ln = torch.nn.LayerNorm(64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return ln(x * 1.0)  # x * 1.0: an activation, not a leaf

    x = _mixed_rows()
    ref = _grads(fn, [x], None)[0]
    with_rule = _cos(_grads(fn, [x], _ctx(8))[0], ref)
    without = _cos(_grads(fn, [x], _ctx(8, rules=False))[0], ref)
    # The rule quantizes the normalised rows: 8-bit rounding of unit-spread values, cosine ~1 - 1e-5.
    assert with_rule >= 0.999
    assert without < 0.9, without


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_batch_norm_input(layout: torch.memory_format) -> None:
    # channels_last (a CNN trained in it): the rule's encoding in the input's memory order, not kept
    # exact (NOTE [ Normalised records in memory order ]).
    x = torch.randn(8, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    tiny = (torch.arange(16) // 2) % 2 == 0  # channels (and GroupNorm's pairs of them) of tiny spread
    x[:, tiny] = 5.0 + 1e-3 * x[:, tiny]
    # GroupNorm's mean and rstd are outputs with a gradient: kept exact by the rule, not quantized;
    # InstanceNorm hands batch_norm its input reshaped to one sample of N * C channels (a copy of a
    # channels_last input).
    norms = (torch.nn.BatchNorm2d(16).train(), torch.nn.GroupNorm(8, 16), torch.nn.InstanceNorm2d(16, affine=True))
    for norm in norms:
        def weight_grad(ctx: daftrain.compress | None, norm: torch.nn.Module = norm) -> torch.Tensor:
            norm.zero_grad(set_to_none=True)
            _grads(lambda x: norm((x * 1.0).contiguous(memory_format=layout)), [x], ctx)
            return torch.cat([norm.weight.grad, norm.bias.grad])

        # The weight gradient sum(g * x_hat) reads the re-normalised input directly.
        ref, ctx = weight_grad(None), _ctx(8)
        assert _cos(weight_grad(ctx), ref) >= 0.999
        # kept by the rule: only the norm's own statistics (GroupNorm's mean and rstd, one of InstanceNorm's)
        statistics = {torch.nn.BatchNorm2d: 0, torch.nn.GroupNorm: 2, torch.nn.InstanceNorm2d: 1}[type(norm)]
        assert ctx.stats.compressed == 1 and ctx.stats.kept_reasons["op_rule"] == statistics, ctx.stats.summary()
        assert _cos(weight_grad(_ctx(8, rules=False)), ref) < 0.9


def _remainder_through_norm(norm: str, ctx: daftrain.compress | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of an input and of an offset per channel (batch norm) or row (layer norm) added before
    the norm, whose output is pooled into a head: each channel's (row's) gradient lies mostly along the
    constant and the normalised values, which the norm's backward takes out, and the offset's gradient, a
    sum of what is left over each channel (row), is exactly zero in plain PyTorch."""
    gen = torch.Generator().manual_seed(0)
    if norm == "batch":  # channels varying mostly across a batch of 4: few effective samples each
        x = torch.randn(4, 64, 1, 1, generator=gen) + 0.05 * torch.randn(4, 64, 4, 4, generator=gen)
        bias, layer = torch.zeros(64, 1, 1), torch.nn.BatchNorm2d(64).train()
        pool = (2, 3)
    else:  # rows of 384: quantization groups straddle rows, which the encoding normalises
        x = torch.randn(4, 16, 1, generator=gen) + 0.05 * torch.randn(4, 16, 384, generator=gen)
        bias, layer = torch.zeros(4, 16, 1), torch.nn.LayerNorm(384)  # an offset per row
        pool = (1,)
    head = torch.nn.Linear(x.shape[1] if norm == "batch" else 384, 10)
    torch.nn.init.normal_(head.weight, generator=gen)
    target = torch.randint(0, 10, (4,), generator=gen)
    leaf, bias = x.requires_grad_(), bias.requires_grad_()
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = F.cross_entropy(head(layer(leaf * 1.0 + bias).mean(pool)), target)
    loss.backward()
    assert leaf.grad is not None and bias.grad is not None
    return leaf.grad, bias.grad


@pytest.mark.parametrize("norm", ["batch", "layer"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_normalised_values_keep_their_statistics(norm: str, bits: int) -> None:
    # NOTE [ Normalised values keep their statistics ]: the restored input has each channel's (row's)
    # exact mean and spread, so the backward's gradient sums to zero over it as plain PyTorch's does: the
    # offset's gradient stays at float32 rounding of sums of a few hundred terms (plain: 2e-7 to 2e-6 of
    # the input gradient's norm; bound 1e-5), where the same input quantized as it is leaves the
    # rounding's own sum there (1e-3 of it at 8 bits, growing with the step).
    x_grad, bias_grad = _remainder_through_norm(norm, None)
    assert float(bias_grad.norm()) <= 1e-5 * float(x_grad.norm())
    got_x, got_bias = _remainder_through_norm(norm, _ctx(bits))
    assert float(got_bias.norm()) <= 1e-5 * float(got_x.norm()), float(got_bias.norm() / got_x.norm())
    assert _cos(got_x, x_grad) >= {2: 0.9, 4: 0.99, 8: 0.999}[bits]  # the suite's bounds per bits
    _, without = _remainder_through_norm(norm, _ctx(bits, rules=False))
    assert float(without.norm()) >= 1e-4 * float(got_x.norm())


def test_decomposed_rms_norm() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:  # as LlamaRMSNorm / T5LayerNorm write it
        h = x * 1.0
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    x[::2] *= 1e-3  # rows of tiny magnitude (RMSNorm does not centre)
    ref = _grads(fn, [x], None)[0]
    assert _cos(_grads(fn, [x], _ctx(8))[0], ref) >= 0.999
    assert _cos(_grads(fn, [x], _ctx(8, rules=False))[0], ref) < 0.9


def _vectors_of_mixed_norms(dim: int) -> torch.Tensor:
    """Vectors along ``dim`` whose norms span four decades, sharing quantization groups."""
    x = torch.randn(8, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    shape = [8, 16, 16, 16]
    shape[dim] = 1
    return x * torch.logspace(-3, 1, x.numel() // 16).reshape(shape)


@pytest.mark.parametrize("dim", [-1, 1])
def test_l2_normalize_input_error_is_not_amplified(dim: int) -> None:
    """``F.normalize`` divides by each vector's exact norm in backward: its input is stored divided by
    the vector's RMS, and the norm (saved expanded) is kept exact."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x * 1.0, dim=dim)

    x = _vectors_of_mixed_norms(dim)
    ref = _grads(fn, [x], None)[0]
    # 8-bit rounding of values within one vector's own scale: cosine ~1 - 1e-5; 2 bits ~0.95
    assert _cos(_grads(fn, [x], _ctx(8))[0], ref) >= 0.999
    assert _cos(_grads(fn, [x], _ctx(2))[0], ref) >= 0.9
    assert _cos(_grads(fn, [x], _ctx(2, rules=False))[0], ref) < 0.9


def _layer_norm_channels_first(x: torch.Tensor) -> torch.Tensor:  # as ConvNeXt-style code writes it
    h = x * 1.0
    u = h.mean(1, keepdim=True)
    return (h - u) / torch.sqrt((h - u).pow(2).mean(1, keepdim=True) + 1e-6)


def _l2_normalize_written_out(x: torch.Tensor) -> torch.Tensor:  # as CLIP-style code writes it
    h = x * 1.0
    return h / h.norm(dim=1, keepdim=True)


@pytest.mark.parametrize("fn", [_layer_norm_channels_first, _l2_normalize_written_out])
def test_division_by_a_statistic_of_the_rows(fn) -> None:
    """``a / s`` with ``s`` of size 1 along the reduced dims (and the norm computing it) is a
    normalisation written out: ``a`` stored normalised over those dims, ``s`` exact."""
    x = _vectors_of_mixed_norms(1)
    ref = _grads(fn, [x], None)[0]
    assert _cos(_grads(fn, [x], _ctx(4))[0], ref) >= 0.99
    assert _cos(_grads(fn, [x], _ctx(2))[0], ref) >= 0.9
    assert _cos(_grads(fn, [x], _ctx(2, rules=False))[0], ref) < 0.9


def test_a_layer_norm_written_out_over_rows_stores_its_centred_input_once() -> None:
    """``y.pow(2)`` (decomposed_rms_norm) and ``y / std`` (statistic_of_rows) both store ``y`` normalised
    per row, in one encoding: one record, as I-BERT's float LayerNorm saves it."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0 - x.mean(-1, keepdim=True)
        return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = _mixed_rows()
    ctx = _ctx(8)
    got = _grads(fn, [x], ctx)[0]
    assert ctx.stats.deduplicated >= 1 and ctx.stats.kept_reasons["op_rule"] >= 1
    assert _cos(got, _grads(fn, [x], None)[0]) >= 0.999


def test_statistic_rule_leaves_other_divisions_and_whole_tensor_norms_alone() -> None:
    from daftrain.saved.op_rules import _statistic

    a = torch.randn(8, 16)
    assert _statistic(torch.div, (a, torch.rand(8, 16) + 1), {}) is None  # elementwise: no statistic
    assert _statistic(torch.div, (a, torch.tensor(2.0)), {}) is None  # a scalar
    assert _statistic(torch.div, (a, torch.rand(1, 1) + 1), {}) is None  # one for the whole tensor
    assert _statistic(torch.div, (a, torch.rand(8, 1) + 1), {"rounding_mode": "floor"}) is None
    assert _statistic(torch.norm, (a,), {}) is None  # no dim: the whole tensor
    found = _statistic(torch.Tensor.__truediv__, (a, torch.rand(8, 1) + 1), {})  # rows: the rows encoding
    assert found is not None and found[0] is a and found[1].view == (8, 1, 16) and found[1].reduce == (2,)
    found = _statistic(torch.div, (torch.randn(4, 8, 16), torch.rand(4, 1, 16) + 1), {})
    assert found is not None and found[1].view == (4, 8, 16) and found[1].reduce == (1,)
    found = _statistic(torch.linalg.vector_norm, (torch.randn(2, 3, 4, 5),), {"dim": (1, 2)})
    assert found is not None and found[1].view == (2, 12, 5)
    assert _statistic(torch.linalg.vector_norm, (torch.randn(2, 3, 4),), {"dim": (0, 2)}) is None  # not one block


def test_transposed_layer_norm_input_is_stored_normalised_in_memory_order() -> None:
    # a convolution's output turned to tokens: the rule's encoding in its memory order, not kept exact;
    # the measure and bounds are test_layer_norm_input_error_is_not_amplified's
    def transposed(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm((x * 1.0).t(), (64,))

    rows = _mixed_rows().t().contiguous()
    ref, ctx = _grads(transposed, [rows], None)[0], _ctx(8)
    assert _cos(_grads(transposed, [rows], ctx)[0], ref) >= 0.999
    assert ctx.stats.kept_reasons["op_rule"] == 0 and ctx.stats.compressed == 1
    assert _cos(_grads(transposed, [rows], _ctx(8, rules=False))[0], ref) < 0.9


def test_clip_masks_of_permuted_inputs_are_exact() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.relu6((x * 4.0).contiguous(memory_format=torch.channels_last))

    x = torch.randn(8, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    ctx = _ctx(2)
    assert torch.equal(_grads(fn, [x], ctx)[0], _grads(fn, [x], None)[0])
    assert ctx.stats.bool_packed == 1 and ctx.stats.kept == 0


def _qk_norm_attention(gain: float):
    b, h, t, d = 2, 4, 64, 16
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, h, t, d, generator=gen) for _ in range(3)]
    weight = torch.full((d,), gain)  # a learned QK-norm gain: the larger, the larger the logits

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qn, kn = F.rms_norm(q * 1.0, (d,), weight), F.rms_norm(k * 1.0, (d,), weight)
        return F.scaled_dot_product_attention(qn, kn, v * 1.0, is_causal=True)

    return fn, inputs


def _flat_grads(fn, inputs: list[torch.Tensor], ctx: daftrain.compress | None) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in _grads(fn, inputs, ctx)])


def test_sdpa_with_qk_norm_keeps_q_and_k_at_eight_bits() -> None:
    fn, inputs = _qk_norm_attention(gain=1.0)  # logits of std ~1: an 8-bit q and k err them by ~0.01 nats
    ref = _flat_grads(fn, inputs, None)
    ctx = _ctx(4)
    with_rule = 1 - _cos(_flat_grads(fn, inputs, ctx), ref)
    without = 1 - _cos(_flat_grads(fn, inputs, _ctx(4, rules=False)), ref)
    # q and k at 8 bits, v at 4 (no output or logsumexp: recomputed in backward); the rest of the error is v's
    # and the norms' 4-bit rounding. Kept: the norms' statistics.
    assert ctx.stats.kept_reasons["op_rule"] == 4 and ctx.stats.compressed == 6
    assert with_rule < 0.5 * without, (with_rule, without)


def test_sdpa_with_large_logits_keeps_what_it_saves_exact() -> None:
    # NOTE [ Attention logits that need more than 8 bits ]: a gain of 4 makes logits of std ~16, which
    # 8-bit q and k would err by ~0.2 nats; q, k and v are kept exact, the norms' inputs quantized.
    fn, inputs = _qk_norm_attention(gain=4.0)
    ref = _flat_grads(fn, inputs, None)
    ctx = _ctx(4)
    with_rule = _cos(_flat_grads(fn, inputs, ctx), ref)
    without = _cos(_flat_grads(fn, inputs, _ctx(4, rules=False)), ref)
    # q, k and v kept beside the norms' four statistics; the norms' inputs and v's input quantized
    assert ctx.stats.kept_reasons["op_rule"] == 7 and ctx.stats.compressed == 3
    assert with_rule >= 0.99 and without < 0.3, (with_rule, without)


def test_sdpa_logits_estimate_is_made_once_per_position(monkeypatch: pytest.MonkeyPatch) -> None:
    fn, inputs = _qk_norm_attention(gain=4.0)
    ctx = _ctx(8)
    calls = []
    estimate = attention_precision.logit_error

    def counted(*args: object, **kwargs: object) -> float:
        calls.append(1)
        return estimate(*args, **kwargs)

    monkeypatch.setattr(attention_precision, "logit_error", counted)
    for _ in range(3):
        _grads(fn, inputs, ctx)
        assert ctx.stats.kept_reasons["op_rule"] == 7
    assert len(calls) == 1  # one forward position, its shapes unchanged: estimated on the first step only


def _biased_attention(gain: float):
    """T5's attention: no 1/sqrt(d) scale and a learned bias, a mask that requires grad (plain SDPA takes its
    math path on CPU and saves the probabilities and ``q * sqrt(scale)`` and ``k * sqrt(scale)``)."""
    b, h, t, d = 2, 4, 64, 16
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, h, t, d, generator=gen) for _ in range(3)]
    inputs.append(0.5 * torch.randn(1, h, t, t, generator=gen))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(gain * q, gain * k, v * 1.0, attn_mask=bias * 1.0, scale=1.0)

    return fn, inputs


@pytest.mark.parametrize("chunks", [1, 8], ids=["whole", "chunked"])
def test_sdpa_with_a_learned_bias_stores_its_inputs_only(chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Attention recomputed from its stored inputs ]: q and k at 8 bits, v at the model's bits, the bias
    # (which 2 bits would err by ~0.5 nats, 8 bits by ~0.006) at 8 bits; no probabilities (n**2 per head) and
    # no copies of q and k. Run a head at a time (``NOTE [ Chunks stored apart ]``), the same for each head's q,
    # k and v, each stored apart.
    from daftrain.saved import recomputed_attention

    if chunks > 1:
        monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", 1)  # one head of each of the 2 samples
    fn, inputs = _biased_attention(gain=0.5)
    ref = _grads(fn, inputs, None)
    ctx, plain = _ctx(4), _ctx(4, rules=False)
    with_rule, without = _grads(fn, inputs, ctx), _grads(fn, inputs, plain)
    assert ctx.stats.compressed == 3 * chunks + 1 and ctx.stats.kept == 0
    assert plain.stats.compressed == 4  # without the rules: the copies of q and k, P and v, all at 4 bits
    # In bits per value of q's size (the groups' lo and scale add under 3 %): P holds t / d = 4 times as many
    # values as q, the bias (shared by the batch of 2) twice as many.
    n, t = inputs[0].numel(), inputs[0].shape[-2]
    assert plain.stats.packed_bytes == pytest.approx(n * (4 + 4 + 4 * t // 16 + 4) / 8, rel=0.05)
    assert ctx.stats.packed_bytes == pytest.approx(n * (8 + 8 + 4 + 2 * 8) / 8, rel=0.05)
    # dv = P^T dO reads no rounded v, only P, recomputed from 8-bit q and k (~0.02x before); dq and dk ~0.4x;
    # the bias's gradient (dS) keeps v's 4-bit rounding through dP = dO v^T (~0.7x)
    for i, factor in ((0, 0.5), (1, 0.5), (2, 0.1), (3, 0.8)):
        error, before = 1 - _cos(with_rule[i], ref[i]), 1 - _cos(without[i], ref[i])
        assert error < factor * before, (i, error, before)


def test_relu6_and_clamp_masks_are_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    # Values crowd both bounds, where rounding would flip the mask.
    x = torch.cat([torch.rand(4096, generator=gen) * 0.02 - 0.01, 6 + torch.rand(4096, generator=gen) * 0.02 - 0.01,
                   torch.randn(4096, generator=gen) * 20]).reshape(64, -1)
    fns = {
        "relu6": lambda x: F.relu6(x * 1.0),
        "relu6_inplace": lambda x: torch.nn.ReLU6(inplace=True)(x * 1.0),
        "hardtanh": lambda x: F.hardtanh(x * 1.0, 0.0, 6.0),
        "clamp": lambda x: torch.clamp(x * 1.0, 0.0, 6.0),
        "clamp_min": lambda x: (x * 1.0).clamp(min=6.0),
        "threshold": lambda x: F.threshold(x * 1.0, 0.0, 0.0),
        "threshold_to_20": lambda x: F.threshold(x * 1.0, 6.0, 20.0),  # the replacement is not read by backward
        # a leaky ReLU reads its input (in place: its output) only through the sign; hardsigmoid is a clip
        "leaky_relu": lambda x: F.leaky_relu(x * 1.0, 0.2),
        "leaky_relu_inplace": lambda x: torch.nn.LeakyReLU(0.2, inplace=True)(x * 1.0),
        "leaky_relu_": lambda x: F.leaky_relu_(x * 1.0),
        "hardsigmoid": lambda x: F.hardsigmoid(x * 2.0 - 3.0),
        "hardsigmoid_inplace": lambda x: torch.nn.Hardsigmoid(inplace=True)((x * 2.0).sub_(3.0)),
        # the gradient passes outside the bounds; an L1 loss reads its input less its target through the sign
        "hardshrink": lambda x: F.hardshrink(x - 6.0, 6.0),
        "softshrink": lambda x: torch.nn.Softshrink(6.0)(x - 6.0),
        "l1_loss": lambda x: F.l1_loss(x * 1.0, torch.full_like(x, 6.0), reduction="none"),
        # one-sided clamps by name, and an L1 norm's sign
        "clamp_min_method": lambda x: (x * 1.0).clamp_min(6.0),
        "clamp_max": lambda x: torch.clamp_max(x * 1.0, 0.0),
        "clamp_min_": lambda x: (x * 1.0).clamp_min_(0.0),
        "l1_norm": lambda x: torch.linalg.vector_norm(x - 6.0, ord=1, dim=-1),
        "norm_p1": lambda x: (x * 1.0).norm(1, dim=0),
    }
    for name, fn in fns.items():
        ref = _grads(fn, [x], None)[0]
        # d/dx of a clip is the mask times the output gradient: with the mask exact it is bit-identical.
        assert torch.equal(_grads(fn, [x], _ctx(2))[0], ref), name
        assert not torch.equal(_grads(fn, [x], _ctx(2, rules=False))[0], ref), name


@pytest.mark.parametrize("call", [
    lambda x: F.margin_ranking_loss(x[:, 0] * 1.0, x[:, 1] * 1.0, torch.ones(x.shape[0]), reduction="none"),
    lambda x: F.triplet_margin_loss(x * 1.0, x.detach() + 0.05, x.detach().flip(0), reduction="none"),
    lambda x: torch.dist(x * 1.0, x.detach() + 1e-3 * torch.arange(x.shape[-1])),
    lambda x: F.cosine_embedding_loss(x * 1.0, _VALUES, torch.arange(256) % 2 * 2.0 - 1.0, reduction="none"),
    lambda x: F.hinge_embedding_loss(x * 20.0, torch.sign(_VALUES), reduction="none"),
    lambda x: F.multi_margin_loss(x * 20.0, torch.arange(256) % 64, reduction="none")])
def test_margin_losses_and_a_distance_keep_what_they_save(call: Any) -> None:
    # A margin ranking loss clamps the difference it makes inside the call at the margin (rounded: the mask flipped
    # for pairs near it, 0.988 at any bits); a triplet loss and torch.dist divide by distances between close points
    # (0.9998 / 0.17 at 8 bits); a cosine embedding loss clamps the cosines it computes at its margin, a hinge
    # embedding loss and a multi-class margin loss their margins less the input. Kept exact, plain's gradient bit
    # for bit.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    ref = _grads(call, [x], None)[0]
    assert torch.equal(_grads(call, [x], _ctx(2))[0], ref)
    assert not torch.equal(_grads(call, [x], _ctx(2, rules=False))[0], ref)


@pytest.mark.parametrize("call", [lambda x: torch.logsumexp(x * 3.0, -1), lambda x: (x * 3.0).logcumsumexp(-1)])
def test_a_logsumexps_input_and_result_get_at_least_8_bits(call: Any) -> None:
    # NOTE [ Nonlinear backward ] in decide.py: the backward is exp(x - result); at 2 bits a step of nats scaled
    # each probability by up to exp(step) (cosine 0.59, logcumsumexp's 0.34). At 8 bits: 0.9998 on these inputs;
    # 0.999 is a bound 2 bits without the rule misses by far.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    ref = _grads(call, [x], None)[0]
    got = _grads(call, [x], _ctx(2))[0]
    assert F.cosine_similarity(got.flatten(), ref.flatten(), dim=0) >= 0.999
    before = _grads(call, [x], _ctx(2, rules=False))[0]
    assert F.cosine_similarity(before.flatten(), ref.flatten(), dim=0) < 0.9


def test_clip_mask_record_is_one_bit_per_value() -> None:
    x = torch.randn(64, 256)
    ctx = _ctx(8)
    _grads(lambda x: F.relu6(x * 1.0), [x], ctx)
    assert ctx.stats.packed_bytes == x.numel() // 8


def test_maximum_and_minimum_against_a_scalar_tensor_are_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    floor = torch.tensor(torch.finfo(torch.float32).min)
    scores = torch.randn(8, 64, 64, generator=gen)
    scores[:, :, 32:] = floor  # an attention mask's floor: the ties, and a group range of ~1e38 next to them
    near = torch.cat([torch.rand(4096, generator=gen) * 0.02 - 0.01, torch.zeros(512)]).reshape(64, -1)
    fns = {
        "max_mask": (lambda x: torch.max(x * 1.0, floor), scores),
        "maximum": (lambda x: torch.maximum(x * 1.0, torch.tensor(0.0)), near),
        "min_method": (lambda x: (x * 1.0).min(torch.tensor(0.0)), near),
        "minimum_first": (lambda x: torch.minimum(torch.tensor(0.0), x * 1.0), near),
    }
    for name, (fn, x) in fns.items():
        ref = _grads(fn, [x], None)[0]
        # with the comparison and the ties exact the gradient is bit-identical (a tie gets half)
        assert torch.equal(_grads(fn, [x], _ctx(2))[0], ref), name
        if name != "max_mask":  # values crowding the compared value: plain rounding flips their side
            assert not torch.equal(_grads(fn, [x], _ctx(2, rules=False))[0], ref), name
    ctx = daftrain.compress(bits=8, min_numel=2, seed=3)  # the 0-d floor kept as it is
    _grads(fns["max_mask"][0], [scores], ctx)
    assert ctx.stats.packed_bytes == 2 * scores.numel() // 8  # the mask and the ties, whatever the bits


@pytest.mark.parametrize("call", [
    lambda a, b: torch.maximum(a * 1.0, b * 1.0), lambda a, b: torch.min(a * 1.0, b * 1.0),
    lambda a, b: (a * 1.0).maximum(b[:1] * 1.0),  # broadcast: the engine sums b's gradient to its shape
    lambda a, b: torch.max((a * 1.0).square(), (a.clamp(-0.2, 0.2) * 1.0).square())])  # PPO's clipped value loss
def test_an_elementwise_extremum_of_two_tensors_saves_their_comparisons(call: Any) -> None:
    # NOTE [ Elementwise extrema save their comparisons ] in extremum.py: ties (half the gradient each), NaNs (all
    # of it to both) and values close together, where two rounded inputs swap sides; plain's gradient bit for bit.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 64, generator=gen) * 0.3
    b = a + torch.randn(256, 64, generator=gen) * 1e-3
    b[::7] = a[::7]
    before = _grads(call, [a, b], _ctx(2, rules=False))  # (a NaN would keep the inputs exact)
    ref = _grads(call, [a, b], None)
    assert not all(r is None or torch.equal(r, g) for r, g in zip(ref, before, strict=True))
    a[3, 5] = b[4, 6] = float("nan")
    ref = _grads(call, [a, b], None)
    ctx = _ctx(2)
    got = _grads(call, [a, b], ctx)
    for r, g in zip(ref, got, strict=True):
        assert (r is None) == (g is None)
        assert r is None or (torch.equal(r.nan_to_num(), g.nan_to_num()) and torch.equal(r.isnan(), g.isnan()))
    assert ctx.stats.bool_packed >= 2


def test_comparison_rule_leaves_reductions_and_nans_alone() -> None:
    x = torch.randn(64, 64)
    for fn in (lambda x: (x * 1.0).max(1).values, lambda x: torch.max(x * 1.0, dim=0).values):
        ctx = _ctx(8)
        _grads(fn, [x], ctx)
        assert ctx.stats.bool_packed == 0
    y = x.clone()
    y[3, 5] = float("nan")
    fn = lambda x: torch.maximum(x * 1.0, torch.tensor(0.0))  # noqa: E731
    ref, got = _grads(fn, [y], None)[0], _grads(fn, [y], _ctx(2))[0]
    assert torch.equal(got, ref)  # a tensor holding a NaN is kept exact


def test_auto_bits_allocate_nothing_to_an_exact_mask() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64)
    ctx = daftrain.compress(bits="auto", avg_bits=4.0, model=model, min_numel=0, seed=0, variance_warning=None)
    for _ in range(2):
        with ctx:
            y = model(x)
            out = torch.maximum(y, torch.tensor(0.5)) + F.relu6(y)
        out.sum().backward()
    assert ctx.stats.bool_packed == 2  # this step's
    # the second linear's input has the allocation's bytes; the two masks are outside it
    assert [s.op for s in ctx.report().slots] == ["linear"]


def test_auto_bits_store_gelu_inputs_as_their_derivative() -> None:
    """A stack of convolution, norm and GELU without a residual path (data2vec-audio's positional
    convolution) compounds the error of GELU's input: auto bits store it as f'(x) as fixed bits do, and
    are no worse than uniform bits at the same bytes (NOTE [ Derivative encoding under bits="auto" ];
    storing it as values gave 4.2x uniform's error)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(16) for m in (torch.nn.Conv1d(16, 16, 5, padding=2),
                                                                    torch.nn.GroupNorm(1, 16), torch.nn.GELU())])
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(2))

    def grad(ctx: daftrain.compress | None) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            out = model(x)
        (out * w).sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    ref = grad(None)
    fixed, auto = [], []
    for seed in range(3):
        uniform = daftrain.compress(bits=4, model=model, seed=seed)
        fixed.append(1 - _cos(grad(uniform), ref))
        ctx = daftrain.compress(bits="auto", avg_bits=4.0, model=model, seed=seed, variance_warning=None)
        grad(ctx)  # the adaptation step
        auto.append(1 - _cos(grad(ctx), ref))
        assert ctx.stats.stored_bytes <= uniform.stats.stored_bytes
    assert sum(auto) <= 1.1 * sum(fixed), (auto, fixed)


def test_exact_mode_traces_nothing() -> None:
    ctx = daftrain.compress(bits=None)
    with ctx:
        assert not torch._C._is_torch_function_mode_enabled()


def test_layer_norm_constant_rows_are_restored_exactly() -> None:
    # A ViT's class and distillation tokens: rows of zeros (and a constant) under LayerNorm with eps 1e-12,
    # so rstd = 1e6 and any rounding of those rows is multiplied by a million.
    ln = torch.nn.LayerNorm(64, eps=1e-12)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    x[::16] = 0.0
    x[1::16] = 0.3

    def fn(x: torch.Tensor) -> torch.Tensor:
        return ln(x * 1.0)

    ref = _grads(fn, [x], None)[0]
    for bits in (8, 2):
        got = _grads(fn, [x], _ctx(bits))[0]
        assert torch.equal(got[::16], ref[::16]) and torch.equal(got[1::16], ref[1::16]), bits
        assert _cos(got, ref) >= 0.999, bits


def _deep_activation_stack(act: torch.nn.Module, gain: float = 1.0) -> torch.nn.Module:
    """Linear -> LayerNorm (weight ``gain``) -> activation, 12 times, no residual path (a positional conv stack)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        norm = torch.nn.LayerNorm(64, elementwise_affine=gain != 1.0)
        if gain != 1.0:
            torch.nn.init.constant_(norm.weight, gain)
        layers += [torch.nn.Linear(64, 64), norm, act]
    return torch.nn.Sequential(*layers)


# Hardswish's f' is linear on (-3, 3), where rounding x or f' errs alike; the rule pays where inputs spread past
# its jumps at -3 and 3 (a CNN's BatchNorm gains): there at a gain of 3, and its f' spans 2 (GELU's 1.26), so
# 4 bits leave it a coarser step: 0.97.
@pytest.mark.parametrize(("act", "gain", "floor"),
                         [(torch.nn.GELU(), 1.0, 0.98), (torch.nn.GELU(approximate="tanh"), 1.0, 0.98),
                          (torch.nn.SiLU(), 1.0, 0.98), (torch.nn.SiLU(inplace=True), 1.0, 0.98),
                          (torch.nn.Mish(), 1.0, 0.98), (torch.nn.Hardswish(inplace=True), 3.0, 0.97)],
                         ids=["gelu", "gelu_tanh", "silu", "silu_inplace", "mish", "hardswish_inplace"])
def test_activation_derivative_does_not_compound(act: torch.nn.Module, gain: float, floor: float) -> None:
    net = _deep_activation_stack(act, gain)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))

    def weight_grads(ctx: daftrain.compress | None) -> torch.Tensor:
        net.zero_grad(set_to_none=True)
        _grads(net, [x], ctx)
        return torch.cat([p.grad.reshape(-1) for p in net.parameters()])

    ref = weight_grads(None)
    without_ctx = _ctx(4, fitted_grids=False, column_groups=False)
    without_ctx._op_tracer = OpTracer(rules=tuple(r for r in RULES if r.name != "activation_derivative"))
    with_rule = _cos(weight_grads(_ctx(4, fitted_grids=False, column_groups=False)), ref)
    without = _cos(weight_grads(without_ctx), ref)
    # f'(x) at 4 bits has a step of ~0.08, x's rounding moves f'(x) by up to (x's step) * 0.8: the error
    # compounding through the 12 layers shrinks; what is left is the linear and LayerNorm inputs'.
    assert with_rule >= floor and (1 - with_rule) < 0.5 * (1 - without), (with_rule, without)
    # Column groups (NOTE [ Groups down the columns ]) and fitted grids (NOTE [ Fitted grids ]) shrink x's
    # own rounding error as well, so they are held off in the comparison above: with them (the defaults) the
    # rule still holds.
    assert _cos(weight_grads(_ctx(4)), ref) >= floor


def _derivative(kind: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x) as the op's own backward computes it."""
    ones = torch.ones_like(x)
    if kind in ("silu", "hardswish", "mish"):
        return getattr(torch.ops.aten, f"{kind}_backward")(ones, x)
    return torch.ops.aten.gelu_backward(ones, x, approximate="tanh" if kind == "gelu_tanh" else "none")


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "silu", "hardswish", "mish"])
def test_derivative_record_restores_the_derivative(kind: str) -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    enc = Derivative(kind)
    record = enc.encode(x.reshape(-1), 8, 256, seed=5)
    restored, decoded = record.decode(), record.inner.decode()
    grad = _derivative(kind, restored)
    # f''s whole range: Hardswish's f' takes (-0.5, 1.5) only inside (-3, 3), whose ends are its jumps.
    assert float(grad.min()) <= float(_derivative(kind, x.reshape(-1)).min()) + 1e-3
    assert float(grad.max()) >= float(_derivative(kind, x.reshape(-1)).max()) - 1e-3
    table_lo, table_hi = float(grad.min()), float(grad.max())
    inside = (decoded >= table_lo) & (decoded <= table_hi)
    # Backward's f'(x') is the decoded value (within the table's resolution) wherever f' can take it.
    assert (grad - decoded)[inside].abs().max() < 1e-5
    assert record.nbytes <= x.numel() * 1.05  # 8 bits per value plus 6 bytes per group
    assert restored.shape == x.reshape(-1).shape and torch.isfinite(restored).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gelu", "hardswish"])
def test_derivative_restore_in_slices_matches_one_lookup(kind: str, dtype: torch.dtype) -> None:
    # NOTE [ The inverse looked up in place ]: slices over several lookups, the last one partial, give the values
    # of one lookup of the whole (then cast) bit for bit; a float32 restore is written over the decoded d.
    n = 3 * _LOOKUP_ELEMENTS + 17
    d = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 2.2 - 0.6  # past f''s range at both ends
    table, d_min, d_max = _inverse_table(kind, d.device)
    pos = (d - d_min).mul_((_INVERSE_POINTS - 1) / (d_max - d_min)).clamp_(0, _INVERSE_POINTS - 1)
    whole = table.index_select(0, pos.round_().to(torch.int64)).to(dtype)
    if kind == "hardswish" and dtype != torch.float32:
        inside = float(torch.nextafter(torch.tensor(3.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)))
        whole.clamp_(-inside, inside)
    buffer = d.clone()
    restored = Derivative(kind).restored(buffer, dtype)
    assert restored.dtype == dtype and torch.equal(restored, whole)
    assert (restored.data_ptr() == buffer.data_ptr()) == (dtype == torch.float32)


def test_derivative_of_an_unknown_activation_is_refused() -> None:
    with pytest.raises(daftrain.InvalidArgumentError, match="Derivative kind"):
        Derivative("relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gelu", "silu", "hardswish", "mish"])
def test_derivative_record_is_unbiased(kind: str, dtype: torch.dtype) -> None:
    # Backward is linear in f'(x'): over rounding seeds its mean is f'(x), also next to Hardswish's jumps at -3
    # and 3 (where a restored x' in a narrower dtype must not round onto a jump) and at the ends of f''s range.
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(16384, generator=gen) * 3, torch.full((256,), -2.999), torch.full((256,), 2.999),
                   torch.full((256,), 3.001), torch.full((256,), -3.001)]).to(dtype)
    exact = _derivative(kind, x).double()
    draws = 64  # seeds far apart: the noise hashes each value's index XOR the seed (``layout.uniform_noise``)
    mean = sum(_derivative(kind, Derivative(kind).encode(x, 4, 256, seed=s * 1_000_003 + 12_345).decode()).double()
               for s in range(draws)) / draws
    # One draw errs by at most one 4-bit step of f' (range <= 2: 2/15 = 0.13), so the mean of 64 by ~0.13 /
    # sqrt(6 * 64) per value (uniform rounding) and over 256-value blocks by ~1/16 of that; a table step is
    # 2.4e-6, the narrower dtypes' own rounding of x' ~2**-8 of f''s slope. The bound: 3 standard errors of a block.
    sd = 0.13 / math.sqrt(6 * draws)
    for block in (mean - exact).split(256):
        assert abs(float(block.mean())) < 3 * sd / 16 + (4e-3 if dtype != torch.float32 else 1e-5), kind


@pytest.mark.parametrize(("fn", "inplace"), [(F.gelu, False), *((f, i) for f in (F.silu, F.hardswish, F.mish)
                                                                for i in (False, True))],
                         ids=["gelu", "silu", "silu_inplace", "hardswish", "hardswish_inplace", "mish",
                              "mish_inplace"])
def test_derivative_rule_matches_in_place_too(fn: Any, inplace: bool) -> None:
    # Out of place the call saves f'(x) itself (NOTE [ Activations that save their derivative ]); in place the op
    # saves autograd's clone of its input, stored as f'(x) too (the same values rounded with the same seed) and
    # restored as an input x' whose f'(x') is that value, within half a step of the inverse table, and inside f''s
    # range: so backward reads the same derivative as out of place, clamped into that range.
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3

    def input_grad(ctx: daftrain.compress | None, in_place: bool = False) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        with ctx if ctx is not None else contextlib.nullcontext():
            y = fn(leaf * 1.0, inplace=True) if in_place else fn(leaf * 1.0)
        y.sum().backward()  # the input's gradient is the derivative backward reads
        if ctx is not None:
            assert ctx.stats.compressed == 1 and ctx.stats.ratio > 7  # one 4-bit record, not a kept copy
        return leaf.grad

    got, out_of_place = input_grad(_ctx(4), in_place=inplace), input_grad(_ctx(4))
    if inplace:
        kind = {F.silu: "silu", F.hardswish: "hardswish", F.mish: "mish"}[fn]
        _, d_lo, d_hi = _inverse_table(kind, torch.device("cpu"))
        half_step = (d_hi - d_lo) / (_INVERSE_POINTS - 1) / 2  # and f'(x') rounded to float32 near 1: 2**-23
        assert torch.allclose(got, out_of_place.clamp(d_lo, d_hi), rtol=0, atol=half_step + 2 * 2**-23)
    else:
        assert torch.equal(got, out_of_place)  # the same rounding draw each time
    ref, without = input_grad(None), input_grad(_ctx(4, rules=False))
    assert (got - ref).norm() < (without - ref).norm(), fn


def test_sdpa_under_autocast_keeps_its_cast_q_and_k_at_eight_bits() -> None:
    # Autocast hands SDPA bfloat16 copies of the float32 q and k: the copies it saves are q and k.
    b, h, t, d = 2, 4, 64, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen) for _ in range(3))
    gain = torch.full((d,), 4.0)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            qn, kn = F.rms_norm(q * 1.0, (d,), gain), F.rms_norm(k * 1.0, (d,), gain)
            return F.scaled_dot_product_attention(qn.float(), kn.float(), v * 1.0, is_causal=True).float()

    ref = torch.cat([g.reshape(-1) for g in _grads(fn, [q, k, v], None)])
    with_rule = _cos(torch.cat([g.reshape(-1) for g in _grads(fn, [q, k, v], _ctx(4))]), ref)
    without = _cos(torch.cat([g.reshape(-1) for g in _grads(fn, [q, k, v], _ctx(4, rules=False))]), ref)
    assert with_rule >= 0.5 and without < 0.3, (with_rule, without)


def _weight_normed_stack(width: int = 64, depth: int = 3) -> torch.nn.Sequential:
    """Linear layers whose weights the forward computes (``weight_norm`` parametrizations)."""
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
    for layer in stack:
        torch.nn.utils.parametrizations.weight_norm(layer)
    return stack


def test_computed_weights_get_eight_bits() -> None:
    # A linear stack's input gradient reads only the weights: at 2 bits their rounding is all its error.
    stack = _weight_normed_stack()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    ref = _grads(stack, [x], None)[0]
    with_rule = _cos(_grads(stack, [x], _ctx(2))[0], ref)
    without = _cos(_grads(stack, [x], _ctx(2, rules=False))[0], ref)
    # 8-bit weights: per-value error ~1/255 of a group's range against ~1/3 at 2 bits.
    assert with_rule >= 0.999 and without < 0.95, (with_rule, without)


def test_computed_weight_error_does_not_shrink_with_the_batch() -> None:
    # The reason for the rule: an activation's rounding error averages over the samples summed into a
    # weight gradient, a shared weight's does not. At two batch sizes, quantize only the computed weights
    # (rules off; activations of batch x 1024 < 1024 x 1024 values are kept below min_numel), then only the
    # activations of the same layers with parameter weights. The samples' gradients share a direction
    # (inputs with a common mean, a loss linear in the output), as those of a training batch do.
    width = 1024
    computed = _weight_normed_stack(width, depth=3)
    plain = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(3)))
    with torch.no_grad():
        for a, b in zip(plain, computed, strict=True):
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)
    weight_errors, activation_errors = [], []
    for batch in (32, 512):
        x = 1.0 + torch.randn(batch, width, generator=torch.Generator().manual_seed(batch))
        for stack, min_numel, errors in ((computed, width * width, weight_errors), (plain, 0, activation_errors)):
            params = list(stack.parameters())

            def grads(ctx: daftrain.compress | None, x: torch.Tensor = x, stack=stack, params=params) -> torch.Tensor:
                stack.zero_grad(set_to_none=True)
                with ctx if ctx is not None else torch.enable_grad():
                    out = stack(x)
                out.mean(0).sum().backward()
                return torch.cat([p.grad.reshape(-1) for p in params])

            ref = grads(None)
            # batch_small=False: the activations under min_numel stay exact (not packed together)
            ctx = daftrain.compress(bits=2, min_numel=min_numel, seed=3, batch_small=False)
            ctx._op_tracer = OpTracer(rules=())
            errors.append(1.0 - _cos(grads(ctx), ref))
            assert ctx.stats.compressed == 2  # the second and third layers' weights, or their inputs
    assert weight_errors[1] > 0.8 * weight_errors[0] > 0, weight_errors
    assert activation_errors[1] < 0.25 * activation_errors[0], activation_errors


def test_computed_weight_rule_matches_its_transposed_and_cast_copies() -> None:
    # The second layer saves its computed weight as weight.t() (under autocast: its bfloat16 copy,
    # transposed); at 8 bits instead of 2 it takes 64 * 64 * 6 / 8 bytes more, and nothing else changes.
    stack = _weight_normed_stack(depth=2)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    for autocast in (False, True):
        packed = []
        for rules in (True, False):
            ctx = _ctx(2, rules=rules)
            with ctx, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = stack(x * 1.0).float()
            y.sum().backward()
            packed.append((ctx.stats.packed_bytes, ctx.stats.compressed))
        assert packed[0][1] == packed[1][1] and packed[0][0] - packed[1][0] == 64 * 64 * 6 // 8, (autocast, packed)


def test_parameter_weights_are_not_computed_weights() -> None:
    layer = torch.nn.Linear(64, 64)
    ctx = _ctx(2)
    with ctx:
        y = layer(torch.randn(256, 64, requires_grad=True) * 1.0)
    y.sum().backward()
    assert ctx.stats.parameters == 1 and ctx.stats.compressed == 1


def test_exact_savings_take_the_loss_over_a_wide_head_and_nothing_else() -> None:
    # NOTE [ Exact training with the loss over the head ]: no saved-tensor hooks; a cross-entropy over a wide layer's
    # output runs over the layer, one over anything else (here the narrow hidden state itself) as plain's
    torch.manual_seed(0)
    body, head = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()), torch.nn.Linear(32, 1000)
    x, y = torch.randn(64, 16), torch.randint(0, 1000, (64,))
    params = [*body.parameters(), *head.parameters()]

    def run(ctx: object) -> tuple[list[str], torch.Tensor, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        with ctx:  # type: ignore[attr-defined]
            h = body(x)
            wide, narrow = F.cross_entropy(head(h), y), F.cross_entropy(h, y % 32)
        (wide + narrow).backward()
        return [type(wide.grad_fn).__name__, type(narrow.grad_fn).__name__], wide.detach(), [p.grad for p in params]

    plain_nodes, plain_loss, plain_grads = run(torch.enable_grad())
    savings = ExactSavings()
    nodes, loss, grads = run(savings)
    assert nodes == ["_OverLinearBackward", plain_nodes[1]]
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)  # float rounding: the loss summed in chunks
    for g, q in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, q, rtol=1e-5, atol=1e-7)
    assert run(savings)[0] == nodes  # entered again
    assert run(torch.enable_grad())[0] == plain_nodes  # and gone once it exits


def test_a_model_may_have_a_wide_head_only_where_a_matrix_could_be_one() -> None:
    # 1000 logits from 16 float32 features: 1000 bytes at 8 bits against 64 exact; a square layer is not one
    assert may_have_wide_head(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1000)))
    assert not may_have_wide_head(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 60)))
    assert may_have_wide_head(torch.nn.Embedding(1000, 16))  # a tied head's weight


def test_layer_norm_input_with_outlier_features_goes_down_the_columns() -> None:
    # NOTE [ Normalised values down the columns ]: a pretrained transformer's outlier features
    ln = torch.nn.LayerNorm(96)
    x = torch.randn(4, 128, 96, generator=torch.Generator().manual_seed(0))
    x[..., [5, 40, 77]] *= 30.0

    def fn(x: torch.Tensor) -> torch.Tensor:
        return ln(x * 1.0)

    ref = _grads(fn, [x], None)[0]
    down = 1 - _cos(_grads(fn, [x], _ctx(4))[0], ref)
    along = 1 - _cos(_grads(fn, [x], _ctx(4, column_groups=False))[0], ref)
    # measured 3.3x less error (the input gradient's error also has the outliers' own share, which no
    # grouping removes); the input's columns hold one feature each, so the choice is clear-cut
    assert down < along / 2, (down, along)


@pytest.mark.parametrize("pool", [torch.nn.MaxPool1d(3, 2, 1),
                                  torch.nn.MaxPool2d((3, 2), stride=(2, 1), padding=(1, 0)),
                                  torch.nn.MaxPool3d(2, ceil_mode=True), torch.nn.MaxPool2d(2, return_indices=True)],
                         ids=["1d", "2d_asymmetric", "3d_ceil", "2d_returning_indices"])
def test_max_pools_store_their_indices_as_window_positions(pool: torch.nn.Module) -> None:
    dims = {torch.nn.MaxPool1d: 1, torch.nn.MaxPool2d: 2, torch.nn.MaxPool3d: 3}[type(pool)]
    x = torch.randn(2, 4, *(15,) * dims, generator=torch.Generator().manual_seed(0))

    def input_grad(ctx: daftrain.compress) -> tuple[torch.Tensor, int]:
        leaf = x.clone().requires_grad_()
        with ctx:
            out = pool(leaf * 1.0)
            y = out[0] if isinstance(out, tuple) else out
        y.pow(2).sum().backward()
        return leaf.grad, y.numel()

    windows, numel = input_grad(with_rule := _ctx(4))
    kept, _ = input_grad(without := _ctx(4, pack_integers=False))
    assert torch.equal(windows, kept)  # the indices restore exactly
    assert with_rule.stats.integer_packed == 1 and without.stats.kept_reasons["integer"] == 1
    assert with_rule.stats.packed_bytes - without.stats.packed_bytes == numel  # one byte an index


def test_multi_head_attention_runs_its_sdpa_under_the_attention_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Tracing the saving op ]: nn.MultiheadAttention calls SDPA inside F.multi_head_attention_forward, which
    # the mode runs opened, so that call is recomputed from its inputs like any other; exact mode is plain's.
    from daftrain.saved import recomputed_attention

    calls: list[int] = []
    apply = recomputed_attention._Recomputed.apply

    def counted(*args: object) -> object:
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(recomputed_attention._Recomputed, "apply", counted)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    x = torch.randn(4, 16, 32)

    def grads(ctx: daftrain.compress | None) -> torch.Tensor:
        layer.zero_grad()
        torch.manual_seed(1)
        with ctx if ctx is not None else contextlib.nullcontext():
            y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in layer.parameters()])

    ref = grads(None)
    assert torch.equal(grads(daftrain.compress(bits=None)), ref) and calls == []
    assert _cos(grads(_ctx(8)), ref) > 0.9999
    assert calls == [1]


def test_a_function_without_the_override_check_stays_closed() -> None:
    from daftrain.saved.op_rules import _opened

    assert _opened(F.multi_head_attention_forward) is not None
    assert _opened(lambda x: x) is None
    assert _opened(torch.add) is None  # a builtin: no code to copy


def test_a_slice_of_a_target_is_told_from_its_neighbours() -> None:
    # NOTE [ Chunks stored apart ]: a chunk of q (samples, or heads of a sample) matches q; k and v cut from the same
    # fused projection (the same memory, dims and strides, other offsets) do not.
    from daftrain.saved.op_rules import _slice_of

    b, t, h, d = 3, 8, 4, 5
    qkv = torch.randn(b, t, 3 * h * d)
    q, k, v = (x.view(b, t, h, d).transpose(1, 2) for x in qkv.split(h * d, -1))
    assert _slice_of(q, q) and _slice_of(q[1:3], q) and _slice_of(q[2:3, 1:3], q) and _slice_of(k[0:1, 3:4], k)
    assert not any(_slice_of(x, q) for x in (k, v, k[1:2], v[0:1, 2:4], v[2:3, 3:4]))
    assert not _slice_of(q[:, :, :, 1:], q[:, :, :, :4]) and not _slice_of(q[0:1], k)
    assert not _slice_of(q.contiguous(), q) and not _slice_of(q[0:1].double(), q) and not _slice_of(q[0], q)



def _cosine_attention_block() -> tuple[Any, list[torch.Tensor], list[torch.nn.Parameter]]:
    """A residual block of attention over unit q and k with a logit scale of 10 (SwinV2's, learned there)."""
    b, t, c, h = 4, 64, 64, 4
    torch.manual_seed(0)
    qkv, out = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)

    def fn(x: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4).unbind(0)
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        return x + out(torch.matmul((scores * 10.0).softmax(-1), v).transpose(1, 2).reshape(b, t, c))

    return fn, [torch.randn(b, t, c, generator=torch.Generator().manual_seed(0))], [*qkv.parameters(),
                                                                                   *out.parameters()]


def test_cosine_attention_keeps_its_unit_vectors_at_eight_bits() -> None:
    fn, inputs, params = _cosine_attention_block()

    def grads(ctx: daftrain.compress | None) -> torch.Tensor:
        for p in params:
            p.grad = None
        return torch.cat([_flat_grads(fn, inputs, ctx), *(p.grad.reshape(-1) for p in params)])

    ref = grads(None)
    errors = {}
    for rule in (True, False):
        ctx = _ctx(4)
        if not rule:  # every other rule as it is: the norms store their inputs normalised either way
            ctx._op_tracer = OpTracer(rules=tuple(r for r in RULES if r.name != "cosine_product"))
        errors[rule] = 1 - _cos(grads(ctx), ref)
    # The scale multiplies the scores' gradient, and with it every rounding error attention's backward reads:
    # the unit q and k at 8 bits take about a third of it away (measured 0.65x at scales 10 and 30, at 4 and 2
    # bits); the rest is v's and the probabilities', which the rule leaves at the configured bits.
    assert errors[True] < 0.75 * errors[False], errors


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(p=2, dim=-1, keepdim=True)  # CLIP's, written out


def _product_records(product: Any, autocast: bool = False) -> list[tuple[int, int]]:
    """Packed bytes and records of ``product`` of two activations at 2 bits, with and without ``cosine_product``."""
    a, b = (torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in (0, 1))
    packed = []
    for rule in (True, False):
        ctx = _ctx(2)
        if not rule:
            ctx._op_tracer = OpTracer(rules=tuple(r for r in RULES if r.name != "cosine_product"))
        with ctx, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = product(a * 1.0, b * 1.0)
        y.float().sum().backward()
        packed.append((ctx.stats.packed_bytes, ctx.stats.compressed))
    return packed


@pytest.mark.parametrize("product", [
    lambda a, b: F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).transpose(-2, -1),
    lambda a, b: torch.matmul(_unit(a), _unit(b).transpose(-2, -1)),
    lambda a, b: torch.bmm(F.normalize(a, dim=-1), F.normalize(b, dim=-1).transpose(1, 2)),
    lambda a, b: torch.einsum("bid,bjd->bij", F.normalize(a, dim=-1), F.normalize(b, dim=-1)),
    lambda a, b: torch.einsum("bid,bjd->bij", [_unit(a), _unit(b)])])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_product_of_unit_vectors_stores_both_at_eight_bits(product: Any, autocast: bool) -> None:
    packed = _product_records(product, autocast)  # under autocast the op saves the operands' bfloat16 casts
    # The same records; two operands of 4 * 64 * 64 values with 6 bits more each.
    assert packed[0][1] == packed[1][1] and packed[0][0] - packed[1][0] == 2 * 4 * 64 * 64 * 6 // 8, packed


@pytest.mark.parametrize("product", [
    lambda a, b: a @ b.transpose(-2, -1),  # a dot-product attention's scores
    lambda a, b: F.normalize(a, dim=-1) @ b.transpose(-2, -1),  # one operand a unit vector
    lambda a, b: (a / a.sum(-1, keepdim=True)) @ b.transpose(-2, -1)])  # divided by a sum, not a norm
def test_other_products_keep_the_configured_bits(product: Any) -> None:
    packed = _product_records(product)
    assert packed[0] == packed[1], packed


def test_absolute_values_store_their_signs_and_zeros_exactly() -> None:
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 1e-2
    x[:, ::7] = 0.0  # the sign of 0 is 0: no gradient there
    x[:, 1] = 50.0  # a wide group range, so that rounding crosses 0
    for fn in (lambda x: torch.abs(x * 1.0), lambda x: (x * 1.0).abs(), lambda x: abs(x * 1.0),
               lambda x: (x * 1.0).abs_()):
        ref = _grads(fn, [x], None)[0]
        assert torch.equal(_grads(fn, [x], _ctx(2))[0], ref)
        assert not torch.equal(_grads(fn, [x], _ctx(2, rules=False))[0], ref)


_TARGET = torch.rand(256, 64, generator=torch.Generator().manual_seed(5))
_VALUES = torch.randn(256, 64, generator=torch.Generator().manual_seed(6))
_IMAGE = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(7))

def _end_point_error(flow: torch.Tensor) -> torch.Tensor:
    off = _VALUES.view_as(flow)
    target = flow.detach() + 1e-3 * off + (_TARGET.view_as(flow) > 0.9) * off
    return torch.sqrt(((flow - target) ** 2).sum(1) + 1e-12)


# NOTE [ Singular backward ] in op_rules.py: each call's backward divides by a value it saves or is singular in
# it, and each input puts values where that factor is large (probabilities near 0 and 1, divisors near 0).
SINGULAR_CALLS = {
    "binary_cross_entropy": lambda x: F.binary_cross_entropy(torch.sigmoid(x * 5.0), _TARGET, reduction="none"),
    "normal_log_prob": lambda x: torch.distributions.Normal(x, F.softplus(x * 3.0) + 1e-3).log_prob(_VALUES),
    "poisson_nll": lambda x: F.poisson_nll_loss(torch.sigmoid(x * 5.0), _TARGET, log_input=False, reduction="none"),
    "division": lambda x: _VALUES / (x.abs() + 0.05),
    "soft_sign": lambda x: x / (x.abs() + 0.05),
    "reciprocal": lambda x: 1.0 / (x.abs() + 0.05),
    "square_root": lambda x: torch.sqrt(x.abs() + 1e-4),
    "power_below_one": lambda x: (x.abs() + 1e-4) ** 0.5,
    "product": lambda x: x.view(256, 16, 4).prod(-1),
    "atan2": lambda x: torch.atan2(x, x * 0.3 + 0.01),
    "lgamma": lambda x: torch.lgamma(x.abs() + 0.01),
    "asin": lambda x: torch.asin(x.clamp(-0.999, 0.999)),
    "xlogy": lambda x: torch.xlogy(_TARGET, torch.sigmoid(x * 5.0)),
    "log_of_sigmoid": lambda x: torch.log(torch.sigmoid(x * 5.0)),
    "grid_sample": lambda x: F.grid_sample(_IMAGE, torch.tanh(x * 2.0).view(8, 32, 32, 2), align_corners=False),
    "cdist": lambda x: torch.cdist(x.view(16, 16, 64), x.view(16, 16, 64).detach() + 0.01 * _VALUES.view(16, 16, 64)),
    "eigh": lambda x: torch.linalg.eigh(x.view(256, 8, 8) + x.view(256, 8, 8).transpose(-1, -2))[1].abs(),
    "solve": lambda x: torch.linalg.solve(x.view(256, 8, 8), _VALUES.view(256, 8, 8)),
    "spectral_norm": lambda x: torch.linalg.matrix_norm(x.view(256, 8, 8), ord=2),
    # special functions and composites: a logit, an inverse normal CDF of a sigmoid's output (its kept result read
    # with the sigmoid's save), a hypotenuse, a division inside addcdiv or softsign, poles of acosh and tan
    "logit": lambda x: torch.logit(torch.sigmoid(x * 4.0)),
    "ndtri_of_sigmoid": lambda x: torch.special.ndtri(torch.sigmoid(x * 4.0)),
    "log_ndtr": lambda x: torch.special.log_ndtr(x * 4.0),
    "hypot": lambda x: torch.hypot(x, x * 0.1 + 0.001),
    "addcdiv": lambda x: torch.addcdiv(_VALUES, _VALUES, x.abs() + 0.05),
    "acosh": lambda x: torch.acosh(x.abs() + 1.0001),
    "tan_of_tanh": lambda x: torch.tan(torch.tanh(x) * 1.55),
    "softsign": lambda x: F.softsign(x * 10.0),
    "float_power": lambda x: torch.float_power(x.abs() + 0.01, 0.5),
    "lp_pool": lambda x: F.lp_pool2d(x.view(256, 1, 8, 8), 2, 2),  # a root of pooled squares
    # NOTE [ Quotients by a kept divisor ] in hooks.py: a standardised residual, squared (a Cauchy's log-likelihood)
    "standardised_residual": lambda x: torch.log1p(((_VALUES - x) / (x.flip(0).abs() + 1e-3)) ** 2),
    "cauchy_log_prob": lambda x: torch.distributions.Cauchy(x, F.softplus(x.flip(0) * 3.0) + 1e-3).log_prob(_VALUES),
    # NOTE [ Saves held for a singular backward ] in singular.py: the square's base, read with the kept root, log or
    # reciprocal (a Charbonnier loss, a total-variation penalty, a Cauchy kernel, a smooth sign through rsqrt)
    "charbonnier": lambda x: torch.sqrt((x - _TARGET) ** 2 + 1e-12),
    "total_variation": lambda x: torch.sqrt(torch.diff(x.view(256, 8, 8), dim=1)[:, :, 1:] ** 2
                                            + torch.diff(x.view(256, 8, 8), dim=2)[:, 1:, :].square() + 1e-8),
    "log_of_square": lambda x: torch.log((x * 2.0).square() + 1e-6),
    "cauchy_kernel": lambda x: (lambda h: 1.0 / (1.0 + h * h / 0.01))(x * 0.5),
    "smooth_sign": lambda x: x * torch.rsqrt(x.pow(2) + 1e-6),
    # a 2-D flow's end-point error written out, where most points are nearly right: a sum of two squares
    "end_point_error": lambda x: _end_point_error(x.view(256, 2, 32)),
}


@pytest.mark.parametrize("name", SINGULAR_CALLS)
def test_a_singular_backward_reads_its_values_exact(name: str) -> None:
    fn, x = SINGULAR_CALLS[name], torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    ref = _grads(fn, [x], None)[0]
    # What the gradient divides by is exact, and so is what else these calls save (a sign, a clip's mask, the grid's
    # tanh: the grid itself), even at 2 bits. The Gaussian's scale is a softplus, whose input gets 8 bits (its
    # derivative exponentiates it; the exponentiated rule).
    bits = 2
    assert _cos(_grads(fn, [x], _ctx(bits))[0], ref) > 0.9995, name
    # Plain quantization at the same bits: below 0.999 (at 8 bits the binary cross-entropy's cosine is -0.04, a
    # product's 0.04, asin's NaN: its input rounded past 1).
    plain = _grads(fn, [x], _ctx(bits, rules=False))[0]
    assert not _cos(plain, ref) > 0.999, (name, _cos(plain, ref))


_ONE_HOT = F.one_hot(torch.arange(256) % 64, 64).float()
# A log of probabilities shifted or clamped by a constant: the probabilities' own save must be exact too.
SHIFTED_PROBABILITIES = {
    "softmax_log_eps": lambda x: -(_ONE_HOT * torch.log(F.softmax(x * 3.0, -1) + 1e-8)),
    "sigmoid_one_minus_eps": lambda x: torch.log(1.0 - torch.sigmoid(x * 5.0) + 1e-7),
    "softmax_clamped": lambda x: torch.log(F.softmax(x * 3.0, -1).clamp(min=1e-8)) * _ONE_HOT,
}


@pytest.mark.parametrize("name", SHIFTED_PROBABILITIES)
def test_a_value_kept_exact_makes_the_save_it_was_shifted_from_exact(name: str) -> None:
    # NOTE [ Every save of a value a singular backward reads ] in hooks.py.
    fn, x = SHIFTED_PROBABILITIES[name], torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    ref = _grads(fn, [x], None)[0]
    assert _cos(_grads(fn, [x], _ctx(2))[0], ref) > 0.99999
    plain = _grads(fn, [x], _ctx(8, rules=False))[0]
    assert not _cos(plain, ref) > 0.999, _cos(plain, ref)


def test_only_small_saves_are_held_for_a_value_shifted_from_them() -> None:
    from daftrain.saved.singular import RECENT_SAVE_BYTES, RECENT_SAVES

    ctx = _ctx(2)
    with ctx:
        for rows in (64, 8192):  # 64 KiB, then 8 MiB of probabilities a call
            for _ in range(3):
                F.softmax(torch.randn(rows, 256, requires_grad=True) * 2.0, -1)
        (torch.randn(64, 256, requires_grad=True) * 2.0).pow(3)  # a save of no probability's op
        held = list(ctx._recent_saves)
        assert len(held) == RECENT_SAVES - 1 and all(t.numel() * 4 <= RECENT_SAVE_BYTES for _, _, t in held)
        assert all(type(node).__name__ == "SoftmaxBackward0" for node, _, _ in held)
    assert not ctx._recent_saves  # released with the forward


def test_the_saves_of_a_square_are_held_for_a_few_saves_only() -> None:
    # NOTE [ Saves held for a singular backward ] in singular.py: a square no singular op reads (a squared ReLU)
    # stays rounded, its tensor released HELD_SAVES saves later, and at the end of the forward.
    from daftrain.saved.singular import HELD_SAVES

    x = torch.randn(256, 64, requires_grad=True)
    ctx = _ctx(2)
    with ctx:
        r = F.relu(x * 1.0)
        y = torch.square(r)
        assert [t.shape for _, _, _, t in ctx._held_saves] == [(256, 64)]
        for _ in range(HELD_SAVES):
            y = torch.sin(y)
        assert len(ctx._held_saves) == 1
        y = torch.sin(y)
        assert not ctx._held_saves
        z = torch.sin(y) * torch.sin(y)  # two tensors: no square
        s = torch.sin(z)
        z = s * s  # one tensor twice: held once
        assert len(ctx._held_saves) == 1
    assert not ctx._held_saves
    (y.sum() + z.sum()).backward()
    assert ctx.stats.kept == 0


def test_every_save_of_a_value_a_singular_backward_reads_is_exact() -> None:
    # NOTE [ Every save of a value a singular backward reads ] in hooks.py: the sigmoid saves p and the log saves p
    # again; both exact, so their factors 1/p and p (1 - p) cancel as in plain PyTorch. Rounded alike they cancel
    # too; kept for the log alone, they did not (0.97 at 8 bits).
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    for fn in (SINGULAR_CALLS["log_of_sigmoid"], SINGULAR_CALLS["binary_cross_entropy"]):
        assert _cos(_grads(fn, [x], _ctx(2))[0], _grads(fn, [x], None)[0]) > 0.99999


def test_a_division_by_a_broadcast_divisor_keeps_only_the_divisor() -> None:
    x = torch.randn(64, 256, requires_grad=True)
    scale = torch.rand(1, 256, requires_grad=True)
    ctx = _ctx(8)
    with ctx:
        y = (x * 1.0) / (scale * 1.0 + 0.5)
    y.sum().backward()
    assert ctx.stats.compressed == 1 and ctx.stats.kept_reasons["op_rule"] == 1  # the dividend quantized


def test_calls_with_nested_arguments_run_as_they_are() -> None:
    # NOTE [ Nested and sparse arguments ] in op_rules.py: before, the GELU raised inside the function that saves
    # its derivative; what jagged tensors save is kept (reason "layout"), the dense tensors their ops save inside
    # are quantized.
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 16)

    def run(ctx: daftrain.compress | None) -> torch.Tensor:
        x = torch.nested.nested_tensor([torch.randn(5, 4, 16, generator=gen), torch.randn(7, 4, 16, generator=gen)],
                                       layout=torch.jagged)
        lin.zero_grad()
        with ctx or contextlib.nullcontext():
            h = F.gelu(lin(x)).transpose(1, 2)
            out = F.scaled_dot_product_attention(h, h, h).values().pow(2).sum()
        out.backward()
        return lin.weight.grad.clone()

    ref = run(None)
    gen.manual_seed(0)
    ctx = _ctx(8)
    assert _cos(run(ctx), ref) > 0.999
    assert ctx.stats.kept_reasons["layout"] > 0


def test_dynamo_compiles_a_power_under_the_rule_mode() -> None:
    # NOTE [ Rules while compiling ]: before, Dynamo's guard on the rules' table failed on the frame that made it
    # ("Guard failed on the same frame it was created") for ``x ** 0.5``, ``x.pow(3)``, ``1 / x``.
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda x: (x.abs() + 1.0) ** 0.5 + x.pow(3) + 1.0 / (x.abs() + 1.0), backend="eager")
        x = torch.randn(64, 64, requires_grad=True)
        with _ctx(8):
            y = fn(x)
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    finally:
        torch._dynamo.reset()



@pytest.mark.parametrize("call", [
    lambda x: (x * 1.0).amax(-1), lambda x: torch.amax(x * 1.0, dim=(0, 1), keepdim=True),
    lambda x: (x * 1.0).amin(0, True), lambda x: (x * 1.0) - (x * 1.0).amax(-1, keepdim=True)])
def test_extrema_save_the_positions_of_their_result(call: Any) -> None:
    # NOTE [ Extrema save their positions ] in extremum.py: ties included (the gradient is split between them);
    # rows of 64 values, so that a group of 256 spans four.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)).round(decimals=1)
    ref = _grads(call, [x], None)[0]
    ctx = _ctx(2)
    assert torch.equal(_grads(call, [x], ctx)[0], ref)
    assert ctx.stats.bool_packed >= 1
    plain = _grads(call, [x], _ctx(8, rules=False))[0]  # a rounded row's maximum equals no rounded value: NaN
    assert not torch.equal(plain, ref)


def test_an_extremum_of_rows_with_a_nan_gives_plain_pytorchs_gradient() -> None:
    x = torch.randn(8, 512)
    x[3, 7] = float("nan")
    ref, got = (_grads(lambda x: (x * 1.0).amax(-1), [x], ctx)[0] for ctx in (None, _ctx(2)))
    assert torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref.nan_to_num(), got.nan_to_num())


@pytest.mark.parametrize(("call", "wrong_before"), [
    (lambda x: (x * 1.0).max(), (8, 2)), (lambda x: torch.min(x * 1.0), (2,)),
    (lambda x: (x * 1.0).max() * torch.ones(64), (8, 2))])
@pytest.mark.parametrize("bits", [8, 2])
def test_a_whole_tensors_extreme_saves_its_positions(call: Any, wrong_before: tuple[int, ...], bits: int) -> None:
    # NOTE [ Extrema save their positions ]: a whole tensor's max() rebuilt from its group's levels need not equal
    # the stored result to the last bit: its gradient was all zeros at any bits; at 2 bits stochastic rounding
    # made ties of a minimum, which took shares of its gradient. Saved as positions, it is plain's bit for bit.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    ref = _grads(call, [x], None)[0]
    assert torch.equal(_grads(call, [x], _ctx(bits))[0], ref)
    if bits in wrong_before:  # a minimum is its group's stored minimum: exact at 8 bits without the rule
        assert not torch.equal(_grads(call, [x], _ctx(bits, rules=False))[0], ref)


def test_a_whole_tensors_maximum_with_a_nan_gives_plain_pytorchs_gradient() -> None:
    # PyTorch's max() returns a NaN and sends the gradient to the NaNs (amax over dims, to none: NaN).
    x = torch.randn(8, 512)
    x[3, 7] = x[5, 1] = float("nan")
    ref, got = (_grads(lambda x: (x * 1.0).max(), [x], ctx)[0] for ctx in (None, _ctx(2)))
    assert torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref.nan_to_num(), got.nan_to_num())


_GROUPS = torch.arange(256) % 16


@pytest.mark.parametrize("call", [
    (lambda x: torch.zeros(16, 64).scatter_reduce(0, _GROUPS[:, None].expand(256, 64), x * 1.0, "amax",
                                                  include_self=False)),
    (lambda x: torch.zeros(16, 64).scatter_reduce(0, _GROUPS[:, None].expand(256, 64), x * 1.0, reduce="amin")),
    (lambda x: torch.zeros(16, 64).index_reduce(0, _GROUPS, x * 1.0, "amax", include_self=False)),
    (lambda x: torch.segment_reduce(x * 1.0, "max", lengths=torch.full((16,), 16))),
    (lambda x: torch.linalg.vector_norm(x * 1.0, ord=float("inf"), dim=-1)),
    (lambda x: torch.norm(x * 1.0, p=float("-inf"), dim=0)),
    (lambda x: torch.ones(16, 64).scatter_reduce(0, _GROUPS[:, None].expand(256, 64), x * 1.0, "prod")),
    (lambda x: torch.ones(16, 64).index_reduce(0, _GROUPS, x * 1.0, "prod"))])
def test_reductions_through_an_index_or_a_norm_keep_what_they_save(call: Any) -> None:
    # A graph network's max pooling (scatter_reduce amax), segment maxima and infinity norms compare their saved
    # input with their saved result (rounded: NaN at 8 bits); a product through an index divides by its factors
    # (cosine 0.99 at 8 bits, 0.23 at 2). Kept exact, the gradient is plain's bit for bit.
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    ref = _grads(call, [x], None)[0]
    ctx = _ctx(2)
    assert torch.equal(_grads(call, [x], ctx)[0], ref)
    assert ctx.stats.kept_reasons["op_rule"] >= 1
    assert not torch.equal(_grads(call, [x], _ctx(2, rules=False))[0], ref)


def test_a_product_of_rounded_tensors_before_a_singular_backward_is_warned_of() -> None:
    # NOTE [ Products before a singular backward ] in hooks.py: a Gram matrix's operands are saved rounded by the
    # product, and the Cholesky factor's gradient multiplies that by up to the matrix's condition number.
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(256, 64)

    def gram(h: torch.Tensor) -> torch.Tensor:
        m = h.view(256, 8, 8)
        return torch.linalg.cholesky(m @ m.transpose(-1, -2) + 1e-3 * torch.eye(8))

    with pytest.warns(daftrain.AmplifiedRoundingWarning, match="Gram or covariance"), _ctx(8):
        gram(linear(x))
    quiet = [lambda h: F.binary_cross_entropy(torch.sigmoid(h), _TARGET[:, :64]), lambda h: torch.log(h.abs() + 1.0),
             lambda h: h / (h * h + 1.0),  # an elementwise division: not warned of
             lambda h: torch.linalg.inv(h.view(-1, 8, 8))]  # a layer's output: its backward reads the weight exact
    with warnings.catch_warnings():
        warnings.simplefilter("error", daftrain.AmplifiedRoundingWarning)
        for fn in quiet:
            with _ctx(8):
                fn(linear(x))
