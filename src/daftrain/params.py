"""Which saved tensors are parameters: one rule for the compression hooks, the importance tracer and
the memory counters."""

from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .lineage import CAST_AND_VIEW_NODES, reaches

__all__ = ["ParameterRegistry", "grad_leaf", "grad_writable", "is_parameter_like", "is_parameter_or_view"]


class ParameterRegistry:
    """The storages of a model's parameters and buffers, so that no view or alias of them is compressed.

    Storages are held by ``StorageWeakRef``: a freed storage whose address is reused can never be
    mistaken for a parameter, and the registry keeps no tensor alive.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._storages: set[StorageWeakRef] = set()
        if model is not None:
            for tensor in (*model.parameters(), *model.buffers()):
                self._storages.add(StorageWeakRef(tensor.untyped_storage()))

    def __len__(self) -> int:
        return len(self._storages)

    def holds(self, t: torch.Tensor) -> bool:
        return bool(self._storages) and StorageWeakRef(t.untyped_storage()) in self._storages


# NOTE [ Recognising parameters ]
# A saved tensor is treated as a parameter (kept as it is, and left out of the byte counts, since the
# model holds it anyway) when any of these holds:
#   1. it is an nn.Parameter, or a view whose ``_base`` is one (``weight.t()`` saved by ``linear``);
#   2. its storage belongs to a parameter or buffer of the ``model`` given to ``compress``;
#   3. it is a leaf that requires grad: in a network only parameters are such leaves;
#   4. it is a cast or view of such a leaf (autocast's ``weight.to(bfloat16).t()``): its grad_fn chain
#      is only casts and views up to an AccumulateGrad node.
# A data pointer alone is never used: addresses are reused as soon as a tensor is freed.
def is_parameter_like(t: torch.Tensor, registry: ParameterRegistry) -> bool:
    if is_parameter_or_view(t):
        return True
    if registry.holds(t):
        return True
    if t.grad_fn is None:
        return t.requires_grad
    return _is_cast_or_view_of_leaf(t.grad_fn)


def is_parameter_or_view(t: torch.Tensor) -> bool:
    """Rule 1 of NOTE [ Recognising parameters ]: an ``nn.Parameter``, or a view whose ``_base`` is one."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _is_cast_or_view_of_leaf(node: object) -> bool:
    return reaches(node, lambda n: type(n).__name__ == "AccumulateGrad", CAST_AND_VIEW_NODES, 4)


def _has_grad_hooks(weight: torch.Tensor) -> bool:
    """Hooks on ``weight``'s gradient that autograd's AccumulateGrad would run."""
    return bool(getattr(weight, "_backward_hooks", None)) or bool(
        getattr(weight, "_post_accumulate_grad_hooks", None))


def grad_leaf(weight: torch.Tensor) -> bool:
    """A leaf that takes a gradient, with no hook on it: all autograd does with its gradient is add it into
    ``.grad``, which a backward may then do itself (``grad_writable``)."""
    return weight.is_leaf and weight.requires_grad and not _has_grad_hooks(weight)


def grad_writable(weight: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether a backward may write ``weight``'s gradient (of ``like``'s dtype and device) into ``.grad`` itself
    rather than return it to autograd (``NOTE [ Weight gradients accumulated in place ]`` in
    ``budget/weight_grads.py``): no graph is being built, no hook waits for it, and ``.grad`` is absent or a
    strided tensor of that dtype and device."""
    if torch.is_grad_enabled() or _has_grad_hooks(weight):
        return False
    grad = weight.grad
    return grad is None or (grad.layout == torch.strided and grad.dtype == like.dtype and grad.device == like.device)
