"""Tensors saved by a node of their own, read by another node's backward when it needs them (``NOTE [ Saved
apart ]``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SavedApart"]


# NOTE [ Saved apart ]
# A node's saved tensors are packed when the node is made, after its forward returned (every output alive by then),
# and unpacked together, by the first read of ``ctx.saved_tensors`` in its backward. Some of the op rules'
# functions need other timings: a tensor packed before the call computes its output (an activation's derivative,
# ``activation_derivative.py``), or parts restored one at a time (a chunked attention's q, k and v,
# ``recomputed_attention.py``). ``SavedApart.apply(link, *parts)`` saves ``parts`` in a node of its own, at once,
# and returns an empty tensor whose ``grad_fn`` is that node; the function that reads them takes the empty tensor
# as an input and keeps its node (``stored.grad_fn``, in its forward), and its backward reads
# ``node.saved_tensors`` when it needs them. The node is an ordinary node of the graph after that function: the
# engine runs it once that function's backward is done (its gradient is nothing) and releases what it saved then,
# as it releases any node's saves, or keeps it under ``retain_graph``. ``link`` (or a part) must require grad, else
# no node is made; it gives the empty tensor its device.
class SavedApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, link: torch.Tensor, *parts: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(*parts)
        ctx.set_materialize_grads(False)
        return link.new_empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        return (None,) * len(ctx.needs_input_grad)
