"""Segments of a model: finding them, checkpointing them for one forward, in-place activations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daftrain
from daftrain.budget.segments import checkpointing, find_segments, inplace_activations


def _two_blocks() -> tuple[nn.Sequential, nn.Sequential]:
    """Two conv-BatchNorm-ReLU blocks, and an identical twin to run plainly."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
                          nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()))
    return model, copy.deepcopy(model)


def test_checkpointing_restores_forward_and_batchnorm_statistics():
    model, twin = _two_blocks()
    x = torch.randn(4, 3, 8, 8)
    segs = find_segments(model)
    assert list(segs) == ["0", "1"]
    with checkpointing(segs, ["0", "1"]):
        assert "forward" in segs["0"].__dict__
        out = model(x)
    assert "forward" not in segs["0"].__dict__
    out.sum().backward()  # recomputes both blocks
    twin(x).sum().backward()
    for a, b in zip(model.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(a, b)  # running stats updated once, not twice
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_checkpointing_under_compress_stores_the_recomputation_compressed():
    model, twin = _two_blocks()
    x = torch.randn(4, 3, 16, 16)
    segs = find_segments(model)
    ctx = daftrain.compress(bits=8, model=model)
    with checkpointing(segs, ["0", "1"], ctx), ctx:
        out = model(x)
    assert ctx.stats.compressed == 0  # nothing inside the blocks was saved by the forward
    out.sum().backward()
    assert ctx.recomputation_context().stats.compressed > 0
    twin(x).sum().backward()
    for a, b in zip(model.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(a, b)  # running stats updated once, not twice
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref = torch.cat([p.grad.flatten() for p in twin.parameters()])
    # 8-bit saved activations: within the op-family floor of tests/saved/test_hooks.py (38 dB, cosine > 0.9999).
    assert F.cosine_similarity(grad, ref, dim=0) > 0.999


def test_checkpointing_puts_back_an_instance_forward():
    block = nn.Linear(4, 4)
    wrapped = block.forward
    block.forward = lambda x: wrapped(x) * 2  # another wrapper's instance forward
    previous = block.__dict__["forward"]
    with checkpointing({"b": block}, ["b"]):
        assert block.__dict__["forward"] is not previous
    assert block.__dict__["forward"] is previous


def test_find_segments_on_nested_models():
    from daftrain.demo.models.resnet import resnet18

    names = list(find_segments(resnet18(width=4)))
    assert names == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


def test_find_segments_falls_back_to_top_level_children():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    assert list(find_segments(Net())) == ["a", "b"]


def test_inplace_activations_exact_and_restored():
    from daftrain.demo.models.resnet import resnet18

    torch.manual_seed(6)
    model = resnet18(width=4).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,))
    x_copy = x.clone()
    with inplace_activations(model) as n:
        assert n == 17  # stem + two per block
        F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert torch.equal(x, x_copy)  # the user's input is never overwritten
    assert not any(m.inplace for m in model.modules() if isinstance(m, nn.ReLU))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_lone_activations_and_dropouts_are_not_segments():
    # NOTE [ Elementwise modules are not segments ]: checkpointing the in-place LeakyReLU kept the input it
    # then overwrote, and the planning step's all-checkpointed probe failed on the version counter.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True),
                          nn.LeakyReLU(0.2, inplace=True), nn.Dropout(0.1), nn.Conv2d(8, 4, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))
    segs = find_segments(model)
    assert list(segs) == ["0", "1", "4", "6", "7"]
    x = torch.randn(8, 3, 8, 8)
    with checkpointing(segs, list(segs)):
        model(x).sum().backward()  # every segment checkpointed: trains
    assert all(p.grad is not None for p in model.parameters())
    step = daftrain.BudgetedStep(model, lambda m, b: m(b).pow(2).mean(), torch.optim.SGD(model.parameters(), 0.1),
                                 budget="1MB", tune_allocator=False)
    with pytest.raises(daftrain.BudgetTooSmallError):
        step(x)
