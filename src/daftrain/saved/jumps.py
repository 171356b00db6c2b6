"""Activations whose derivative jumps at 0 (PReLU, SELU, ELU with alpha other than 1), run as functions that save
which side of 0 each input lies on (``NOTE [ Derivatives that jump at 0 ]``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..calls import argument

__all__ = ["saving_sides"]

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


# NOTE [ Derivatives that jump at 0 ]
# PReLU's derivative is 1 above 0 and its learned slope below; SELU's is 1.05 above and up to 1.76 below (ELU's
# 1 and up to alpha). Their backward reads the saved input's side of 0 through that jump, and a rounded input near
# 0 lands on the wrong side: PReLU's input gradient 0.9988 at 8 bits, SELU's 0.9994, where a continuous
# activation's is 0.99999. A clip's mask alone (``clip_mask``) does not do: PReLU's slope gradient sums the
# negative inputs themselves, and ELU's derivative below 0 is its output plus alpha. So an out-of-place call runs
# as a function that saves ``x > 0`` (1 bit a value, exact) beside its input, rounded as any activation: the input
# gradient takes the side from the mask (PReLU's: plain PyTorch's bit for bit), the values only below 0 (ELU's
# ``alpha * scale * exp(x)`` at the rounded input, clamped to 0 where rounding crossed it).
class _PReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x > 0, x, weight)
        return torch.prelu(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        positive, x, weight = ctx.saved_tensors
        slope = weight.view(1, -1, *([1] * (x.dim() - 2))) if weight.numel() > 1 else weight
        grad_x = torch.where(positive, grad, slope * grad)
        per_value = torch.where(positive, 0, x * grad)
        grad_weight = (per_value.sum([d for d in range(x.dim()) if d != 1]) if weight.numel() > 1
                       else per_value.sum()).view(weight.shape)
        return grad_x, grad_weight


class _ELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x > 0, x)
        ctx.alpha, ctx.scale = alpha, scale
        return torch.ops.aten.elu(x, alpha, scale, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        positive, x = ctx.saved_tensors
        below = torch.exp(torch.clamp_max(x, 0)) * (ctx.alpha * ctx.scale)  # a rounded x above 0 stays below
        return torch.where(positive, grad * ctx.scale, grad * below), None, None


def saving_sides(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call of ``F.prelu``, ``F.selu`` or ``F.elu`` (alpha other than 1) as a function that saves its input's
    side of 0 (``NOTE [ Derivatives that jump at 0 ]``), or ``None`` where it is in place, not on a floating-point
    tensor that needs a gradient, or of another function."""
    x = argument(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.layout != torch.strided:
        return None
    if func is F.prelu:
        weight = argument(args, kwargs, 1, "weight")
        if not isinstance(weight, torch.Tensor) or weight.dtype != x.dtype or not (
                (x.requires_grad or weight.requires_grad) and torch.is_grad_enabled()):
            return None
        if weight.numel() != 1 and (x.dim() < 2 or weight.numel() != x.shape[1]):
            return None  # PyTorch's own error
        return lambda *_, **__: _PReLU.apply(x, weight)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return None
    if func is F.selu:
        inplace = argument(args, kwargs, 1, "inplace", False)
        return None if inplace else (lambda *_, **__: _ELU.apply(x, _SELU_ALPHA, _SELU_SCALE))
    if func is F.elu:
        alpha, inplace = argument(args, kwargs, 1, "alpha", 1.0), argument(args, kwargs, 2, "inplace", False)
        if inplace or not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha == 1.0:
            return None  # at alpha 1 the derivative is continuous
        if not math.isfinite(alpha) or alpha <= 0:
            return None
        return lambda *_, **__: _ELU.apply(x, float(alpha), 1.0)
    return None
