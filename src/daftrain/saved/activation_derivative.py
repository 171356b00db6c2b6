"""Smooth activations that save their derivative, not their input (``NOTE [ Activations that save their
derivative ]``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import UnsupportedError
from .records import derivative_of
from .saved_apart import SavedApart

__all__ = ["DOUBLE_BACKWARD_THROUGH_DERIVATIVE", "saving_derivative"]


# NOTE [ Activations that save their derivative ]
# GELU, SiLU, Mish and Hardswish save their input x, and their backward computes ``grad * f'(x)`` into a
# new tensor: at that op the decoded input, the incoming gradient and the outgoing one are alive, three
# tensors of the activation's size (a transformer's widest: its FFN's hidden layer). Under the
# ``activation_derivative`` rule the record stores f'(x) anyway (``NOTE [ Activations stored as their
# derivative ]`` in ``records.py``), so an out-of-place call runs as a function whose backward multiplies the
# incoming gradient into the decoded d = f'(x), in place: two tensors of that size at that op, not three, and
# no inverse of f' to look up in decoding. d (computed by the op's own backward, as that encoding computes it;
# float32, float64 for a float64 input) is saved apart, before the output is computed (``NOTE [ Saved apart
# ]`` in ``saved_apart.py``): a node's own saves are packed after its forward, when the output is alive too,
# and PyTorch's op packs its input before computing its output, so x, d and the output would be alive at
# once where x and d were. The product is made in place only where the restored d is a fresh decode (not the
# tensor saved, alive and kept as it is: a second backward under ``retain_graph`` would read it again). d is
# not a function of x in the graph, so the backward has no derivative of its own: a ``create_graph`` backward
# through it raises (the folded input the encoding restores would give f'' at the wrong point outside f''s
# increasing interval). In-place calls keep the encoding (their input is overwritten; autograd saves a clone of
# it).
class _SavingDerivative(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],  # type: ignore[override]
                saved: tuple[StorageWeakRef, int], stored: torch.Tensor) -> torch.Tensor:
        ctx.store, ctx.saved, ctx.dtype = stored.grad_fn, saved, x.dtype
        return run(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise UnsupportedError(DOUBLE_BACKWARD_THROUGH_DERIVATIVE)
        (d,) = ctx.store.saved_tensors
        saved, saved_at = ctx.saved
        fresh = saved.expired() or d.data_ptr() != saved_at
        return (d.mul_(grad) if fresh else d * grad).to(ctx.dtype), None, None, None


DOUBLE_BACKWARD_THROUGH_DERIVATIVE = (
    "a backward that builds a graph (create_graph=True) reached a GELU, SiLU, Mish or Hardswish whose input "
    "compress() stored as its derivative, which has no derivative of its own: pass double_backward=True to "
    "compress (those activations then store their input, rounded), or run that forward under compress(bits=None)")


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


_RUNS: dict[str, Callable[..., torch.Tensor]] = {
    "silu": F.silu, "mish": F.mish, "hardswish": F.hardswish,
    "gelu": functools.partial(_gelu, approximate="none"), "gelu_tanh": functools.partial(_gelu, approximate="tanh")}


def saving_derivative(kind: str, traffic: Callable[[int], None] | None = None) -> Callable[..., torch.Tensor]:
    """An out-of-place call of the activation ``kind`` (one of ``Derivative``'s kinds; its arguments but the input
    are those ``kind`` names) run as a function that saves its derivative (``NOTE [ Activations that save their
    derivative ]``); ``traffic`` is told the derivative's bytes before it is made, as a pack hook is told its
    tensor's (``NOTE [ Freed memory goes back to the OS ]`` in ``allocator.py``)."""
    run = _RUNS[kind]

    def call(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # F.gelu's name
        dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
        if traffic is not None:
            traffic(input.numel() * dtype.itemsize)
        with torch.no_grad():
            d = derivative_of(kind, input.to(dtype))
        stored = SavedApart.apply(input, d)  # packed now, before the output exists
        saved = StorageWeakRef(d.untyped_storage()), d.data_ptr()
        del d
        return _SavingDerivative.apply(input, run, saved, stored)

    return call
