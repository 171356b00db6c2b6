"""decide.py's own rules: a softmax's saved output keeps its rows' sums (``NOTE [ Probabilities keep their sums ]``
in records.py), found by its node wherever it is saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import daftrain
from daftrain.saved import decide
from daftrain.saved.op_rules import RULES, OpTracer


def _attention(ctx: daftrain.compress | None, math_path: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of q and of an additive mask (one logit offset per query row, or a whole float mask for
    SDPA's math path) of one attention call. Softmax's backward sums to zero over each row, so the offsets'
    gradient, and each row of the mask's, is exactly zero in plain PyTorch."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=gen) for _ in range(3))
    k = k + 2.0  # keys with a common direction, which a row's leftover sum turns into a bias of dq
    q, v = q.requires_grad_(), v.requires_grad_()  # v trained: P @ V saves P too
    mask = torch.zeros(2, 4, 64, 64 if math_path else 1, requires_grad=True)
    with ctx if ctx is not None else torch.enable_grad():
        if math_path:  # a float mask that requires grad: CPU SDPA takes its math path, which saves P
            out = F.scaled_dot_product_attention(q * 1.0, k, v, attn_mask=mask)
        else:
            out = torch.softmax((q * 1.0) @ k.transpose(-2, -1) / 8.0 + mask, dim=-1) @ v
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    assert q.grad is not None and mask.grad is not None
    return q.grad, mask.grad.sum(-1)


def _ctx(math_path: bool) -> daftrain.compress:
    """2 bits; for SDPA's math path without the attention rule, under which SDPA saves no P (``NOTE [ Attention
    recomputed from its stored inputs ]``, tested in ``test_recomputed_attention.py``)."""
    ctx = daftrain.compress(bits=2, min_numel=0, seed=3)
    if math_path:
        ctx._op_tracer = OpTracer(rules=tuple(r for r in RULES if r.name != "attention_qk"))
    return ctx


@pytest.mark.parametrize("math_path", [False, True])
def test_softmax_rows_keep_their_sums(math_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    plain_q, plain_rows = _attention(None, math_path)
    # float32 rounding of 64-term sums of the logits' gradient: plain's own is ~1e-8 of dq's norm; bound 1e-5
    assert float(plain_rows.norm()) <= 1e-5 * float(plain_q.norm())
    ctx = _ctx(math_path)
    got_q, got_rows = _attention(ctx, math_path)
    assert float(got_rows.norm()) <= 1e-5 * float(got_q.norm()), float(got_rows.norm() / got_q.norm())
    # P is stored once: the product that saves it again (P @ V) reads the same record
    assert ctx.stats.deduplicated >= 1
    error = float((got_q - plain_q).norm())
    monkeypatch.setattr(decide, "_SOFTMAX_OUTPUT_NODES", frozenset())  # P quantized as it is
    without_q, without_rows = _attention(_ctx(math_path), math_path)
    assert float(without_rows.norm()) >= 1e-2 * float(without_q.norm())
    # the leftover row sums were a bias of dq along the keys' common direction: less error without it
    assert error < float((without_q - plain_q).norm())


def _classifier(ctx: daftrain.compress | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a head's weight and bias under log_softmax and nll_loss: log_softmax's backward sums to
    zero over each row, so the bias's gradient sums to zero over the classes in plain PyTorch."""
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(256, 64, generator=gen), torch.randint(0, 100, (256,), generator=gen)
    head = torch.nn.Linear(64, 100)
    with ctx if ctx is not None else torch.enable_grad():
        loss = F.nll_loss(F.log_softmax(head(x) * 3.0, dim=-1), target)
    loss.backward()
    assert head.weight.grad is not None and head.bias.grad is not None
    return head.weight.grad, head.bias.grad


def test_log_softmax_rows_keep_their_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    # bound 1e-6 of the bias gradient's norm: float32 rounding of 256-term sums (plain's own is ~1e-8)
    _, plain_bias = _classifier(None)
    assert abs(float(plain_bias.sum())) <= 1e-6 * float(plain_bias.norm())
    _, got_bias = _classifier(daftrain.compress(bits=2, min_numel=0, seed=3))  # log_softmax's floor: 8 bits
    assert abs(float(got_bias.sum())) <= 1e-6 * float(got_bias.norm()), float(got_bias.sum() / got_bias.norm())
    monkeypatch.setattr(decide, "_softmax_output", lambda t, log=False: decide._LOG_SOFTMAX_OUTPUT)
    _, without = _classifier(daftrain.compress(bits=2, min_numel=0, seed=3))  # 8 bits as they are
    assert abs(float(without.sum())) >= 1e-4 * float(without.norm())
