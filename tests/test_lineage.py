"""lineage.py: which saved tensors count as copies an op made of its operand (NOTE [ Copies an op saves ])."""

from __future__ import annotations

import torch

from daftrain.lineage import copy_of, reached, reaches


def _activation(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True) * 1.0


def test_casts_clones_and_views_are_copies() -> None:
    x = _activation(4, 6)
    assert copy_of(x.to(torch.bfloat16), x)
    assert copy_of(x.t().contiguous(), x)
    assert copy_of(x.clone(), x, same_shape=True)
    assert not copy_of(x.t().contiguous(), x, same_shape=True)  # other shape
    assert not copy_of(x * 2.0, x)  # computed, not copied
    assert not copy_of(x[:2].clone(), x)  # other values


def test_same_order_copies_hold_the_logical_order_contiguously() -> None:
    x = _activation(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert copy_of(x.reshape(1, 6, 4, 5), x, same_order=True)  # x cannot be viewed so: a copy
    assert copy_of(x.to(torch.bfloat16).reshape(-1), x, same_order=True)
    y = _activation(6, 8)
    assert not copy_of(y.t().contiguous(), y, same_order=True)  # the transposed order
    assert not copy_of(x.permute(0, 2, 3, 1).contiguous(), x, same_order=True)  # the memory order
    assert not copy_of(y.t(), y, same_order=True)  # not contiguous
    leaf = torch.randn(6, 8)
    assert not copy_of(leaf.reshape(48), leaf, same_order=True)  # no graph to follow


def test_reached_names_the_node_a_walk_back_through_shifts_ends_at() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    p = torch.softmax(x, -1)
    shifted = (p + 1e-8).clamp(min=1e-9).view(32)
    through = frozenset({"AddBackward0", "ClampBackward1", "ViewBackward0"})
    assert reached(shifted.grad_fn, lambda n: n is p.grad_fn, through, 3) is p.grad_fn
    assert reached(shifted.grad_fn, lambda n: n is p.grad_fn, through, 2) is None  # three steps back
    assert reached((p * x).grad_fn, lambda n: n is p.grad_fn, frozenset({"MulBackward0"}), 3) is None  # two inputs
    assert reaches(shifted.grad_fn, lambda n: n is p.grad_fn, through, 3)
