"""Who saves what the hooks pack: a ``torch.utils.checkpoint`` region's inputs, a custom Function's saves, or
autograd's own formulas (``saved/nesting.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from daftrain.saved.nesting import CHECKPOINT_INPUT, saving_function


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def _told(run) -> list[object]:  # type: ignore[no-untyped-def]
    told: list[object] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        told.append(saving_function())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(torch.randn(8, 8, requires_grad=True) * 1.0)
    return told


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpoints_input_is_told_from_other_saves(use_reentrant: bool) -> None:
    # The region's saves go to checkpoint's own hooks (non-reentrant) or are not made (reentrant): the one save
    # seen is the region's input.
    assert _told(lambda x: checkpoint(lambda h: h.sin().cos(), x, use_reentrant=use_reentrant)) == [CHECKPOINT_INPUT]


def test_a_custom_functions_saves_are_told_by_its_class() -> None:
    # sin saves its input through autograd's own formula; the Function saves sin's output.
    assert _told(lambda x: _Square.apply(x.sin())) == [None, _Square]
