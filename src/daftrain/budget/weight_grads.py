"""Weight gradients accumulated in place: while ``weight_grads_in_place(model)`` is active, the model's
``Linear`` and ``Embedding`` layers add their weight gradient straight into ``.grad`` in backward
instead of handing autograd a new weight-sized tensor to add."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function_variadic

from ..params import grad_leaf, grad_writable

__all__ = ["weight_grads_in_place"]

# NOTE [ Weight gradients accumulated in place ]
# Autograd returns each weight gradient as a new tensor, and the weight's AccumulateGrad node adds it to
# ``.grad``. That costs weight-sized memory at the top of a step in two ways:
#   1. from a step's second micro-batch on ``.grad`` exists, so the new gradient is a transient of the
#      weight's size beside it (for a vocabulary head, next to the logits' gradient);
#   2. a weight used twice (an embedding tied to the output head) has one AccumulateGrad node with two
#      inputs: the engine holds the head's contribution in its input buffer until the embedding's
#      backward, the last to run, has produced the other, itself a dense weight-sized tensor.
# While the context is active, an eligible ``Linear`` computes ``grad.addmm_(g^T, x)`` and an eligible
# ``Embedding`` ``grad.index_add_(0, ids, g)`` in its backward and returns no gradient for the weight:
# no weight-sized tensor is allocated, held or added (the first contribution allocates ``.grad``, as
# AccumulateGrad would). The sums are autograd's, added in another order: exact up to float summation
# order, as accumulating micro-batches already is.
# A layer runs as usual where the result could differ from autograd's: a subclass that overrides
# ``forward`` or a module whose ``forward`` was replaced, a weight that is not a leaf requiring grad or
# that has hooks (which AccumulateGrad would run), a forward under autocast (the cast weight is not the
# leaf), embeddings with ``max_norm``, ``scale_grad_by_freq`` or sparse gradients. A backward that builds
# a graph (``create_graph``), or a ``.grad`` of another dtype, device or layout, gets the weight's
# gradient returned to autograd as usual. The caller keeps the context active over the backward too: a
# checkpointed block recomputes its forward there and must save what its forward saved. Parameter
# hooks that do not show on the tensor, such as DistributedDataParallel's on the AccumulateGrad node,
# are the caller's to rule out (``BudgetedStep`` does not use the context under DDP).
# A head whose output a cross-entropy takes over (``NOTE [ Exact training with the loss over the head ]`` in
# ``saved/op_rules.py``) gets no gradient through this function: the loss adds the weight's gradient into
# ``.grad`` itself, tile by tile, under the same rules (``params.grad_writable``).


# NOTE [ The parameter itself ]
# Backward adds into the ``.grad`` of the parameter object the forward was given, held on ``ctx``: what
# ``ctx.saved_tensors`` returns passed through the saved-tensor hooks in force (compression, counting,
# checkpointing), which may hand back another tensor with the same values, whose ``.grad`` is not the
# parameter's. The Linear's weight is saved as well, for its values and autograd's in-place check.


def _eligible(weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and grad_leaf(weight) and not torch.is_autocast_enabled(weight.device.type)


class _LinearInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # NOTE [ The parameter itself ]
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        param = ctx.param
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if not grad_writable(param, g2):
            return grad_x, g2.t().mm(x2), grad_bias
        if param.grad is None:
            param.grad = g2.t().mm(x2)
        else:
            param.grad.addmm_(g2.t(), x2)
        return grad_x, None, grad_bias


class _EmbeddingInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.param = weight  # NOTE [ The parameter itself ]
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,), param = ctx.saved_tensors, ctx.param
        flat_ids, rows = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        if ctx.padding_idx is not None:
            keep = flat_ids != ctx.padding_idx
            flat_ids, rows = flat_ids[keep], rows[keep]
        if grad_writable(param, rows) and param.grad is not None:
            param.grad.index_add_(0, flat_ids, rows)
            return None, None, None
        contribution = torch.zeros_like(param, dtype=rows.dtype).index_add_(0, flat_ids, rows)
        if not grad_writable(param, rows):
            return None, contribution, None
        param.grad = contribution
        return None, None, None


# NOTE [ Seen as a linear ]
# ``bits="auto"`` learns which torch function saved each tensor, and how the gradient of its output
# scales the tensor's rounding noise, from a ``TorchFunctionMode`` (``auto/tracing.py``); so do the op
# rules (``saved/op_rules.py``). An ``autograd.Function`` saves its tensors outside any call that mode
# sees, so the Linear inputs saved by ``_LinearInPlace`` would go unattributed and get the median
# importance of the others, whatever their real weight in the gradient. ``linear`` below is therefore a
# torch function of its own: under a mode it hands itself to the mode, which runs it and attributes what
# it saved to a call named ``linear`` with ``F.linear``'s arguments, the op it computes.
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight's gradient added into ``.grad`` in backward; a torch
    function as ``F.linear`` is (NOTE [ Seen as a linear ])."""
    if has_torch_function_variadic(x, weight, bias):
        return handle_torch_function(linear, (x, weight, bias), x, weight, bias)
    return _LinearInPlace.apply(x, weight, bias)


def _linear_forward(mod: nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _eligible(mod.weight):
            return F.linear(x, mod.weight, mod.bias)
        return linear(x, mod.weight, mod.bias)
    return forward


def _embedding_forward(mod: nn.Embedding) -> Any:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        if not _eligible(mod.weight):
            return nn.Embedding.forward(mod, ids)
        return _EmbeddingInPlace.apply(ids, mod.weight, mod.padding_idx)
    return forward


def _patchable(mod: nn.Module) -> bool:
    if "forward" in vars(mod):  # replaced already (e.g. by an offloading hook): not ours to wrap
        return False
    if type(mod).forward is nn.Linear.forward:
        return True
    return type(mod).forward is nn.Embedding.forward and mod.max_norm is None and \
        not mod.scale_grad_by_freq and not mod.sparse


@contextlib.contextmanager
def weight_grads_in_place(model: nn.Module) -> Iterator[int]:
    """Accumulate the weight gradients of ``model``'s ``Linear`` and ``Embedding`` layers in place (NOTE
    [ Weight gradients accumulated in place ]); keep it active over the backward. Yields the number of
    layers affected; their ``forward`` is restored on exit."""
    mods = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)) and _patchable(m)]
    for m in mods:
        m.forward = _linear_forward(m) if isinstance(m, nn.Linear) else _embedding_forward(m)  # type: ignore[method-assign]
    try:
        yield len(mods)
    finally:
        for m in mods:
            del m.forward
