"""Cross-entropy over class indices that saves its logits, not their log-softmax: one full-size tensor less
in its backward (``NOTE [ Cross-entropy that saves its logits ]``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNK_BYTES", "REDUCTIONS", "cross_entropy_saving_logits", "saves_logits"]

CHUNK_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}
"""By device, the backward computes the gradient of as many rows at a time as fit in this many bytes of logits
(at least one): its two temporaries are that size. On a GPU each chunk costs three launches of host time, so
its chunks are larger; 4 MiB elsewhere."""


# NOTE [ Cross-entropy that saves its logits ]
# ``F.cross_entropy`` over class indices is ``log_softmax`` then ``nll_loss``. Autograd saves the
# log-probabilities (as large as the logits: a language model's 8 x 256 x 50257 floats are 412 MB), and its
# backward holds three tensors of that size at once: ``nll_loss``'s gradient, the decoded log-probabilities
# and ``log_softmax``'s gradient. Under ``compress`` the call runs as one function instead: its forward
# computes the loss with the same ops (bit for bit) and saves the logits (quantized like the
# log-probabilities were, at least ``LOGITS_MIN_BITS``: backward exponentiates them); its backward runs
# PyTorch's own two backward ops a chunk of rows at a time (``CHUNK_BYTES``), recomputing that chunk's
# log-probabilities from the decoded logits, and writes the gradient into one tensor: two tensors of the
# logits' size at once (the decoded logits and the gradient), not three. Each row's arithmetic is plain
# PyTorch's, so the gradient from exact logits is bit for bit plain's. Under ``create_graph`` the same ops
# run on the whole tensor, differentiable. Only the common call is taken over (2-D float32 logits, 1-D class
# indices, no class weights, no label smoothing, a mean or a sum); any other runs as it is.
def saves_logits(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The logits of a ``F.cross_entropy`` call this module takes over, else ``None``."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    bound = dict(zip(names, args, strict=False)) | kwargs
    x, target = bound.get("input"), bound.get("target")
    if not (isinstance(x, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    plain = (bound.get("weight") is None and bound.get("size_average") is None and bound.get("reduce") is None
             and bound.get("label_smoothing", 0.0) == 0.0 and bound.get("reduction", "mean") in ("mean", "sum"))
    shapes = (x.dim() == 2 and x.dtype == torch.float32 and target.dim() == 1 and target.dtype == torch.int64
              and x.shape[0] == target.shape[0] and x.layout == torch.strided and not x.is_nested)
    return x if plain and shapes and x.requires_grad and torch.is_grad_enabled() else None


def cross_entropy_saving_logits(input: torch.Tensor, target: torch.Tensor, weight: Any = None,
                                size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                                reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` for a call ``saves_logits`` took (the same signature and loss)."""
    return _SavingLogits.apply(input, target, ignore_index, reduction)


REDUCTIONS = {"mean": 1, "sum": 2}
"""ATen's reduction enum, for its loss ops."""


class _SavingLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,  # type: ignore[override]
                reduction: str) -> torch.Tensor:
        loss, total_weight = torch.ops.aten.nll_loss_forward(torch.log_softmax(logits, 1), target, None,
                                                             REDUCTIONS[reduction], ignore_index)
        ctx.ignore_index, ctx.reduction = ignore_index, REDUCTIONS[reduction]
        ctx.save_for_backward(logits, target, total_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        logits, target, total_weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the same ops on the whole tensor, differentiable
            log_probs = torch.log_softmax(logits, 1)
            nll = torch.ops.aten.nll_loss_backward(grad, log_probs, target, None, ctx.reduction, ctx.ignore_index,
                                                   total_weight)
            return torch.ops.aten._log_softmax_backward_data(nll, log_probs, 1, logits.dtype), None, None, None
        out = torch.empty_like(logits)
        chunk_bytes = CHUNK_BYTES.get(logits.device.type, CHUNK_BYTES["cpu"])
        step = max(1, chunk_bytes // max(1, logits.shape[1] * logits.element_size()))
        log_probs = logits.new_empty((min(step, logits.shape[0]), logits.shape[1]))
        nll = torch.empty_like(log_probs)
        for s in range(0, logits.shape[0], step):
            n = min(step, logits.shape[0] - s)
            torch._log_softmax(logits[s:s + n], 1, False, out=log_probs[:n])
            torch.ops.aten.nll_loss_backward.grad_input(grad, log_probs[:n], target[s:s + n], None, ctx.reduction,
                                                        ctx.ignore_index, total_weight, grad_input=nll[:n])
            torch.ops.aten._log_softmax_backward_data.out(nll[:n], log_probs[:n], 1, logits.dtype, out=out[s:s + n])
        return out, None, None, None
