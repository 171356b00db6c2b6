"""Which saves are a ``torch.utils.checkpoint`` region's inputs (``saved/nesting.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from daftrain.saved.nesting import saved_by_torch_checkpoint


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def _told(run) -> list[bool]:  # type: ignore[no-untyped-def]
    told: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        told.append(saved_by_torch_checkpoint())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(torch.randn(8, 8, requires_grad=True) * 1.0)
    return told


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoints_input_is_told_from_other_saves(use_reentrant: bool) -> None:
    # The region's saves go to checkpoint's own hooks (non-reentrant) or are not made (reentrant): the one save
    # seen is the region's input.
    assert _told(lambda x: checkpoint(lambda h: h.sin().cos(), x, use_reentrant=use_reentrant)) == [True]


def test_op_and_custom_function_saves_are_not_a_checkpoints() -> None:
    assert _told(lambda x: _Square.apply(x.sin())) == [False, False]
