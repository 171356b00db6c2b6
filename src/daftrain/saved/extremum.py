"""Maxima and minima over dims that save which values attain them, not the values (``NOTE [ Extrema save
their positions ]``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["extremum_saving_positions"]


# NOTE [ Extrema save their positions ]
# ``amax`` / ``amin`` over some dims save their input and their result, and their backward sends the gradient,
# split evenly, to the values equal to the result. Rounded, a row's maximum need equal no rounded value (only a
# quantization group's extremes are exact, and a group spans rows): its count was 0 and the gradient NaN (a
# softmax written out as ``x - x.amax(-1, keepdim=True)``, at 8 bits). Those calls run as a function that saves
# the positions equal to the result, a bool mask (packed at 1 bit a value), and computes the gradient from it
# with PyTorch's own formula (``scale_grad_by_count``): bit for bit plain PyTorch's. A whole tensor's ``max()``
# / ``min()`` is its groups' extreme, which rounding keeps: it is left as it is.
class _AlongDims(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool,  # type: ignore[override]
                largest: bool) -> torch.Tensor:
        out = torch.amax(x, dims, keepdim) if largest else torch.amin(x, dims, keepdim)
        ctx.save_for_backward(x == _with_dims(out, dims, keepdim))
        ctx.dims, ctx.keepdim = dims, keepdim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        grad = _with_dims(grad, ctx.dims, ctx.keepdim)
        return (grad / mask.sum(ctx.dims, keepdim=True)) * mask, None, None, None


def _with_dims(t: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    """``t``, reduced over ``dims`` (sorted, non-negative), with those dims back at size 1."""
    if keepdim:
        return t
    for d in dims:
        t = t.unsqueeze(d)
    return t


def extremum_saving_positions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call ``func(*args, **kwargs)`` of ``amax`` / ``amin`` as a function that saves the positions of its
    result (``NOTE [ Extrema save their positions ]``), or ``None`` where it is not one on a floating-point tensor
    that needs a gradient."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
        return None
    if not (x.requires_grad and torch.is_grad_enabled()):
        return None  # nothing is saved
    name = getattr(func, "__name__", "")
    if name not in ("amax", "amin"):
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim", ())
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    dims = tuple(sorted({d % x.dim() for d in dims})) if dims else tuple(range(x.dim()))
    largest = name == "amax"
    return lambda *a, **k: _AlongDims.apply(x, dims, keepdim, largest)
