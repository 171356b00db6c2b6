"""Autograd semantics under compress: what plain PyTorch guarantees still holds, and unusual saved tensors
(expanded views, empty tensors) work in every mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import daftrain


@pytest.mark.parametrize("bits", [None, 8, 2])
def test_in_place_modification_after_save_raises_as_in_plain_pytorch(bits):
    x = torch.randn(64, 128, requires_grad=True)
    y = torch.sigmoid(x)  # sigmoid saves its output
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        y.sum().backward()

    with daftrain.compress(bits=bits, min_numel=0):
        y = torch.sigmoid(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
        y.sum().backward()
    assert isinstance(ours.value, daftrain.DaftrainError)
    assert "expected version 0" in str(plain.value) and "expected version 0" in str(ours.value)


@pytest.mark.parametrize("bits", [None, 8, 2])
def test_unmodified_saves_still_backpropagate(bits):
    x = torch.randn(64, 128, requires_grad=True)
    with daftrain.compress(bits=bits, min_numel=0):
        y = torch.sigmoid(x)
    y2 = y * 1  # an out-of-place use does not count as a modification
    (y2.sum() + y.sum()).backward()
    assert torch.isfinite(x.grad).all()


def _expanded_forward(f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    gate = torch.sigmoid(g).expand_as(f)  # squeeze-excitation gate: stride 0 over H, W
    mask = (f > 0).expand(2, *f.shape)  # a bool mask broadcast over a new leading dimension
    kv = f[:, :1].expand(-1, 8, -1, -1)  # one key/value head expanded to all heads
    return (f * gate).sum() + torch.where(mask, f.expand(2, *f.shape), 0.0).sum() + (kv * f).sum()


@pytest.mark.parametrize("bits", [None, 8, 2])
def test_expanded_views_restore_as_views_and_store_their_real_size(bits):
    torch.manual_seed(0)
    f = torch.randn(4, 8, 32, 32, requires_grad=True)
    g = torch.randn(4, 8, 1, 1, requires_grad=True)
    _expanded_forward(f, g).backward()
    ref = (f.grad.clone(), g.grad.clone())
    f.grad = g.grad = None
    with daftrain.compress(bits=bits, min_numel=0) as ctx:
        out = _expanded_forward(f, g)
    out.backward()
    if bits is None:
        assert torch.equal(f.grad, ref[0]) and torch.equal(g.grad, ref[1])
    else:
        cos = torch.nn.functional.cosine_similarity(torch.cat([f.grad.flatten(), g.grad.flatten()]),
                                                    torch.cat([ref[0].flatten(), ref[1].flatten()]), dim=0)
        assert cos > (0.999 if bits == 8 else 0.9)
    if bits is not None:
        # The broadcast copies are not stored: every record is at most the size of f itself.
        assert ctx.stats.packed_bytes < 4 * f.numel() * 2


def test_expanded_view_restores_with_its_strides():
    from daftrain.saved.records import compact_expanded, is_expanded

    t = torch.randn(4, 1, 16).expand(4, 8, 16)
    assert is_expanded(t) and not is_expanded(t.contiguous())
    c = compact_expanded(t)
    assert c.shape == (4, 1, 16) and torch.equal(c.expand(4, 8, 16), t)


def test_an_expanded_view_is_sized_by_what_it_stores():
    """``min_numel`` counts an expanded view's real values: a per-row norm broadcast over its row is as
    small as the norm (kept exact as "tiny"), not as large as the row."""
    from daftrain.saved.records import stored_numel

    norm = torch.rand(64, 1, requires_grad=True) + 0.5
    assert stored_numel(norm.expand(64, 128)) == 64 and stored_numel(torch.randn(4, 8)) == 32
    x = torch.randn(64, 128, requires_grad=True)
    with daftrain.compress(bits=2, min_numel=4096) as ctx:
        y = x * norm.expand(64, 128)  # saves the expanded view: 8192 values seen, 64 stored
    y.sum().backward()
    assert ctx.stats.kept_reasons["tiny"] == 1 and ctx.stats.compressed == 0


@pytest.mark.parametrize("bits", [None, 2])
def test_empty_saved_tensor_with_min_numel_zero(bits):
    x = torch.zeros(0, 5, requires_grad=True)
    with daftrain.compress(bits=bits, min_numel=0) as ctx:
        y = torch.sigmoid(x * 2)
    y.sum().backward()
    assert x.grad.shape == (0, 5)
    assert ctx.stats.kept_reasons["empty"] >= 1


def test_model_of_the_wrong_type_is_refused_with_the_parameter_named():
    with pytest.raises(daftrain.ArgumentTypeError, match=r"model must be a torch\.nn\.Module"):
        daftrain.compress(model=123)
    with pytest.raises(TypeError, match="config must be a CompressionConfig"):
        daftrain.compress(2)
    daftrain.compress(model=nn.Linear(2, 2))
