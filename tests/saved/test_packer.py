"""Asynchronous packing: identical results to the synchronous path, in-place safety, accounting."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daftrain
from daftrain.demo.models.resnet import resnet18
from daftrain.saved.packer import InPlaceModificationError


def _train_steps(asynchronous: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = resnet18(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = daftrain.compress(bits=2, model=model, seed=7, asynchronous=asynchronous, min_numel=512)
    grads = []
    for step in range(steps):
        x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(step))
        y = torch.arange(8) % 10
        with ctx:
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
    ctx.close()
    return grads


def test_asynchronous_packing_gives_bit_identical_training():
    sync, asyn = _train_steps(False), _train_steps(True)
    for a, b in zip(sync, asyn, strict=True):
        assert torch.equal(a, b)


def test_stats_wait_for_the_packer_and_count_pending_bytes():
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))
    x = torch.randn(256, 512, requires_grad=True)
    ctx = daftrain.compress(bits=2, asynchronous=True)
    with ctx:
        out = model(x * 1.0)
    stats = ctx.stats
    assert stats.compressed == 3  # x*1.0, the first linear's output, the GELU output
    assert stats.peak_pending_bytes >= 256 * 512 * 4  # at least one raw region waited
    out.sum().backward()
    ctx.close()


def test_in_place_change_before_packing_is_an_error_not_a_wrong_gradient():
    ctx = daftrain.compress(bits=2, asynchronous=True, min_numel=0)
    gate = torch.zeros(())
    h = torch.randn(512, 512, requires_grad=True) * 1.0
    # Block the worker so the in-place change lands before it packs.
    import threading

    release = threading.Event()
    ctx._packer._executor.submit(release.wait)
    with ctx:
        y = h.sin()
    with torch.no_grad():
        h.add_(1.0)
    release.set()
    with pytest.raises(InPlaceModificationError, match="in-place"):
        (y + gate).sum().backward()
    ctx.close()


def test_many_steps_under_load_stay_consistent():
    # A stress run: 20 steps of a small MLP, with the main thread racing the packer; each step's
    # gradient must equal the synchronous one.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)])
    xs = [torch.randn(128, 256, requires_grad=True) for _ in range(20)]

    def run(asynchronous):
        ctx = daftrain.compress(bits=4, seed=3, asynchronous=asynchronous, min_numel=0)
        out = []
        for x in xs:
            model.zero_grad()
            with ctx:
                loss = model(x * 1.0).square().mean()
            loss.backward()
            out.append(model[0][0].weight.grad.clone())
        ctx.close()
        return out

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_stats_can_be_read_after_close():
    lin = nn.Linear(256, 64)
    ctx = daftrain.compress(bits=2, asynchronous=True, seed=0)
    with ctx:
        out = lin(torch.randn(64, 256, requires_grad=True) * 1.0)
    out.sum().backward()
    ctx.close()  # every queued job has finished: stats needs no packer
    assert ctx.stats.compressed == 1
