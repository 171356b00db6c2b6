"""Tensors saved apart (``saved/saved_apart.py``): packed when saved, read by another node's backward when it
needs them, released by the engine as any node's saves are."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from daftrain.saved.saved_apart import SavedApart


class _Square(torch.autograd.Function):
    """``x ** 2``, whose backward reads ``x`` from a node saved apart (a stand-in for a function that needs its
    parts at another time than its own saves)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.store = stored.grad_fn
        return x.square()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.store.saved_tensors
        return grad * 2 * x, None


def test_parts_are_packed_when_saved_and_read_when_needed() -> None:
    events: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        events.append("pack")
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        events.append("unpack")
        return t

    x = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        stored = SavedApart.apply(x, x.detach())
        events.append("saved")
        out = _Square.apply(x, stored)
    assert events == ["pack", "saved"]  # packed at the call, before the function that reads it ran
    out.sum().backward()
    assert events == ["pack", "saved", "unpack"]
    assert torch.equal(x.grad, 2 * x.detach())


def test_the_engine_releases_the_parts_after_the_reader_or_keeps_them_under_retain_graph() -> None:
    x = torch.randn(8, requires_grad=True)
    stored = SavedApart.apply(x, x.detach())
    out = _Square.apply(x, stored)
    out.sum().backward(retain_graph=True)
    assert len(stored.grad_fn.saved_tensors) == 1
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _ = stored.grad_fn.saved_tensors


def test_no_node_without_a_tensor_that_requires_grad() -> None:
    x = torch.randn(8)
    assert SavedApart.apply(x, x.square()).grad_fn is None
