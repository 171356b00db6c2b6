"""Activations whose derivative jumps at 0 save their input's side of 0 (``saved/jumps.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import daftrain
from daftrain.saved.jumps import saving_sides
from daftrain.saved.op_rules import OpTracer


def _ctx(bits: int, rules: bool = True) -> daftrain.compress:
    ctx = daftrain.compress(bits=bits, min_numel=0, seed=3)
    if not rules:
        ctx._op_tracer = OpTracer(rules=())
    return ctx


def _near_zero() -> torch.Tensor:
    """Inputs crowding 0, where a rounded value crosses it, in groups that also hold large ones."""
    g = torch.Generator().manual_seed(0)
    near, wide = torch.rand(8192, generator=g) * 0.02 - 0.01, torch.randn(8192, generator=g) * 4
    return torch.cat([near, wide]).view(16, 16, 64)


def _grads(fn, x: torch.Tensor, params: list[torch.Tensor], ctx) -> list[torch.Tensor]:
    leaf = x.detach().clone().requires_grad_()
    for p in params:
        p.grad = None
    if ctx is None:
        out = fn(leaf)
    else:
        with ctx:
            out = fn(leaf)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return [leaf.grad, *(p.grad.clone() for p in params)]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("channels", [16, 1])
def test_prelus_input_gradient_is_plains_and_its_slope_gradient_close(channels: int) -> None:
    # NOTE [ Derivatives that jump at 0 ]: the side of 0 is exact, so the input gradient (the slope or 1 times the
    # incoming gradient) is plain's bit for bit at any bits; the slope's gradient sums the rounded negative inputs
    # (8 bits: within 1e-4 of plain's direction; the input's error is that of any activation).
    weight = torch.full((channels,), 0.25, requires_grad=True)
    fn = lambda x: F.prelu(x * 1.0, weight)  # noqa: E731
    x = _near_zero()
    ref = _grads(fn, x, [weight], None)
    for bits in (8, 2):
        got = _grads(fn, x, [weight], _ctx(bits))
        assert torch.equal(got[0], ref[0])
        if bits == 8:
            assert _cos(got[1], ref[1]) > 0.9999
    before = _grads(fn, x, [weight], _ctx(8, rules=False))
    assert not torch.equal(before[0], ref[0])


@pytest.mark.parametrize("fn", [lambda x: F.selu(x * 1.0), lambda x: F.elu(x * 1.0, alpha=2.0)])
def test_an_elus_jump_at_zero_is_read_from_the_side_saved(fn) -> None:
    # Below 0 the derivative is alpha * scale * exp(x) of the rounded input; the side is exact. At 8 bits over
    # groups spanning +-16 (a step of 1/8) exp(x) errs by up to 13 %, unbiased: measured 0.99996-0.99997, where plain
    # rounding, flipping values near 0 between slopes 1.05 and 1.76 (SELU; 1 and 2 for ELU's alpha 2), gave
    # 0.99947 / 0.99909: a tenth of that error or less.
    x = _near_zero()
    ref = _grads(fn, x, [], None)[0]
    got = _grads(fn, x, [], _ctx(8))[0]
    before = _grads(fn, x, [], _ctx(8, rules=False))[0]
    assert _cos(got, ref) > 0.9999
    assert 1 - _cos(got, ref) < 0.1 * (1 - _cos(before, ref))


def test_calls_that_need_no_function_run_as_they_are() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    assert saving_sides(F.elu, (x,), {}) is None  # alpha 1: a continuous derivative
    assert saving_sides(F.elu, (x, 2.0, True), {}) is None  # in place
    assert saving_sides(F.selu, (x,), {"inplace": True}) is None
    assert saving_sides(F.selu, (x.detach(),), {}) is None  # no gradient: nothing saved
    assert saving_sides(F.prelu, (x, torch.ones(3)), {}) is None  # PyTorch's own shape error
    assert saving_sides(F.selu, (x,), {}) is not None
