"""Maxima and minima over dims that save which values attain them, not the values (``NOTE [ Extrema save
their positions ]``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..calls import argument, reduced_dims

__all__ = ["extremum_saving_positions", "pairwise_extremum_saving_comparisons", "reads_positions"]


# NOTE [ Extrema save their positions ]
# ``amax`` / ``amin`` over some dims save their input and their result, and their backward sends the gradient,
# split evenly, to the values equal to the result. Rounded, a row's maximum need equal no rounded value (only a
# quantization group's extremes are exact, and a group spans rows): its count was 0 and the gradient NaN (a
# softmax written out as ``x - x.amax(-1, keepdim=True)``, at 8 bits). Those calls run as a function that saves
# the positions equal to the result, a bool mask (packed at 1 bit a value), and computes the gradient from it
# with PyTorch's own formula (``scale_grad_by_count``): bit for bit plain PyTorch's. A whole tensor's ``max()``
# / ``min()`` runs the same way over every dim, with PyTorch's ties for it (a NaN result goes to the NaNs): its
# rounded extreme, a group's end rebuilt as ``min + scale * level``, need not equal the stored result to the last
# bit either (``x.max()``'s gradient was all zeros, at any bits), and at 2 bits stochastic rounding makes values
# ties of a group's minimum, which took a share of its gradient.
# Reductions that read the positions through an index (``scatter_reduce`` / ``index_reduce`` with ``amax`` or
# ``amin``: a graph network's max pooling; ``segment_reduce``'s ``max`` / ``min``) and an infinity norm (the
# largest absolute value) compare their input with their result the same way, NaN where none is equal, but their
# backward is an aten formula over the saved input, index and result: those calls keep what they save exact
# (``reads_positions``).
class _AlongDims(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool,  # type: ignore[override]
                largest: bool, whole: bool) -> torch.Tensor:
        if whole:  # Tensor.max() / min(): a NaN is the result, and the NaNs share its gradient
            out = torch.max(x) if largest else torch.min(x)
            mask = torch.where(out.isnan(), x.isnan(), x == out)  # no host read of the result
        else:
            out = torch.amax(x, dims, keepdim) if largest else torch.amin(x, dims, keepdim)
            mask = x == _with_dims(out, dims, keepdim)
        ctx.save_for_backward(mask)
        ctx.dims, ctx.keepdim = dims, keepdim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        grad = _with_dims(grad, ctx.dims, ctx.keepdim)
        return (grad / mask.sum(ctx.dims, keepdim=True)) * mask, None, None, None, None


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
    x = argument(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
        return None
    if not (x.requires_grad and torch.is_grad_enabled()):
        return None  # nothing is saved
    name = getattr(func, "__name__", "")
    if name in ("max", "min"):  # a whole tensor's only: with a dim it returns indices, with a tensor it compares
        if len(args) + len(kwargs) != 1:
            return None
        largest = name == "max"
        return lambda *a, **k: _AlongDims.apply(x, tuple(range(x.dim())), False, largest, True)
    if name not in ("amax", "amin"):
        return None
    dim = argument(args, kwargs, 1, "dim", ())
    keepdim = bool(argument(args, kwargs, 2, "keepdim", False))
    dims = reduced_dims(x.dim(), dim)
    largest = name == "amax"
    return lambda *a, **k: _AlongDims.apply(x, dims, keepdim, largest, False)


# NOTE [ Elementwise extrema save their comparisons ]
# ``maximum(a, b)`` / ``minimum(a, b)`` (and ``max`` / ``min`` of two tensors) save both inputs, and their backward
# reads them only through the comparison: the larger one gets the gradient, a tie half of it each, a NaN on
# either side all of it on both. Rounded apart, two values that were equal (a clipped and an unclipped value loss
# in PPO, which agree wherever the clip is inactive) no longer were, and values close together swapped sides
# (a value loss's gradient 0.99977 at 8 bits, where the loss without the clip gave 0.99999). Such a call where a
# gradient is wanted runs as a function that saves ``a <= b`` and ``a >= b`` (1 bit a value each: both for a
# tie, neither for a NaN) and computes PyTorch's own formula from them; the engine sums a broadcast input's
# gradient to its shape, as for the op itself. Bit for bit plain PyTorch's, in fewer bytes than the two inputs.
class _Pairwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, largest: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a <= b, a >= b)
        ctx.largest = largest
        return torch.maximum(a, b) if largest else torch.minimum(a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        at_most, at_least = ctx.saved_tensors
        shared = torch.where(at_most & at_least, grad / 2, grad)
        below, above = at_most & ~at_least, at_least & ~at_most
        a_loses, b_loses = (below, above) if ctx.largest else (above, below)
        return shared.masked_fill(a_loses, 0), shared.masked_fill(b_loses, 0), None


def pairwise_extremum_saving_comparisons(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call ``func(*args, **kwargs)`` of ``maximum`` / ``minimum`` (or ``max`` / ``min`` of two tensors) as a
    function that saves the comparison of its inputs (``NOTE [ Elementwise extrema save their comparisons ]``), or
    ``None`` where it is not one of two floating-point tensors of one dtype and device, one needing a gradient."""
    name = getattr(func, "__name__", "")
    if name not in ("maximum", "minimum", "max", "min") or len(args) + len(kwargs) != 2:
        return None
    a, b = argument(args, kwargs, 0, "input"), argument(args, kwargs, 1, "other")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if not (a.is_floating_point() and b.dtype == a.dtype and b.device == a.device and a.layout == torch.strided
            and b.layout == torch.strided):
        return None
    if not ((a.requires_grad or b.requires_grad) and torch.is_grad_enabled()):
        return None  # nothing is saved
    largest = name in ("maximum", "max")
    return lambda *_, **__: _Pairwise.apply(a, b, largest)


_REDUCE_ARG = {"scatter_reduce": (4, "reduce"), "scatter_reduce_": (4, "reduce"), "index_reduce": (4, "reduce"),
               "index_reduce_": (4, "reduce"), "segment_reduce": (1, "reduce")}
_NORM_ARG = {"linalg_vector_norm": (1, "ord"), "linalg_norm": (1, "ord"), "linalg_matrix_norm": (1, "ord"),
             "norm": (1, "p")}


def reads_positions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reductions: frozenset[str]) -> bool:
    """Whether the call is a reduction by one of ``reductions`` (``"amax"``, ``"amin"``, ``"max"``, ``"min"``,
    ``"prod"``) through an index or by segments, or (where ``reductions`` has ``"amax"``) an infinity norm."""
    name = getattr(func, "__name__", "")
    if name in _REDUCE_ARG:
        at, key = _REDUCE_ARG[name]
        reduce = argument(args, kwargs, at, key)
        return reduce in reductions
    if name in _NORM_ARG and "amax" in reductions:
        at, key = _NORM_ARG[name]
        order = argument(args, kwargs, at, key, kwargs.get("ord"))
        return isinstance(order, (int, float)) and not isinstance(order, bool) and math.isinf(order)
    return False
