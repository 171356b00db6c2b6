"""Activations that save their derivative (``saved/activation_derivative.py``): plain's output and gradient on
exact saves, the product made in place only in a fresh decode, no double backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import daftrain
from daftrain.errors import UnsupportedError
from daftrain.saved.activation_derivative import saving_derivative

PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish,
         "hardswish": F.hardswish}


def _input(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    return torch.cat([x.flatten(), torch.tensor([-3.0, 3.0, 0.0])]).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_plain_output_and_gradient_on_exact_saves(kind: str, dtype: torch.dtype) -> None:
    # The output is the activation's own; the gradient is grad * f'(x) with f'(x) from the op's own backward, in
    # float32 (float64 for float64): plain's to the rounding of that product (and, for bfloat16, of f' in bfloat16).
    x = _input(dtype)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    out, ref = saving_derivative(kind)(x), PLAIN[kind](x)
    assert out.dtype == dtype and torch.equal(out, ref)
    (got,) = torch.autograd.grad(out, x, w)
    (expected,) = torch.autograd.grad(ref, x, w)
    tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype and torch.allclose(got, expected, rtol=tol, atol=tol)


class _Saves:
    """Saved-tensor hooks that keep what was saved (``copies=False``: the tensor itself) or a copy of it,
    restoring a fresh copy each time; the last restored tensor is ``restored``."""

    def __init__(self, copies: bool) -> None:
        self.copies, self.restored = copies, None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if self.copies else t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.restored = t.clone() if self.copies else t
        return self.restored


def test_the_product_is_made_in_a_fresh_decode_only() -> None:
    # NOTE [ Activations that save their derivative ]: a restored copy becomes the gradient (no third tensor of
    # the input's size); the tensor saved itself, alive and restored again by a second backward, is left alone.
    h = _input(torch.float32) * 1.0
    fresh = _Saves(copies=True)
    with fresh.hooks():
        out = saving_derivative("gelu")(h)
    (grad,) = torch.autograd.grad(out.sum(), h)
    assert fresh.restored is not None and grad.data_ptr() == fresh.restored.data_ptr()
    kept = _Saves(copies=False)
    with kept.hooks():
        out = saving_derivative("gelu")(h)
    first = torch.autograd.grad((out * 2).sum(), h, retain_graph=True)[0]
    assert kept.restored is not None and first.data_ptr() != kept.restored.data_ptr()
    second = torch.autograd.grad((out * 2).sum(), h)[0]
    assert torch.equal(first, second)


def test_a_double_backward_is_refused() -> None:
    # NOTE [ A backward differentiated again ] in hooks.py: the error names the option that stores the input.
    x = _input(torch.float32)
    out = saving_derivative("silu")(x * 1.0)
    with pytest.raises(UnsupportedError, match=r"create_graph.*double_backward=True"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_compress_stores_the_derivative_and_runs_no_activation_backward() -> None:
    # Under the rule, an out-of-place GELU saves f'(x) (one record, quantized, not a kept constant) and its
    # backward is a product: no gelu_backward op runs in backward.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = _input(torch.float32)
    ctx = daftrain.compress(bits=4, min_numel=0)
    with ctx:
        out = F.gelu(x * 1.0)
    assert ctx.stats.compressed == 1 and ctx.stats.kept == 0
    ops = Ops()
    with ops:
        out.sum().backward()
    assert "gelu_backward" not in ops.names and "mul_" in ops.names
