"""RSS measurement, meters, the bytes a step will allocate, and the saved-bytes counter."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from daftrain.budget.memory import (
    RssMeter,
    SavedBytesCounter,
    format_bytes,
    meter_for,
    missing_grad_bytes,
    missing_state_bytes,
)
from daftrain.errors import UnsupportedError

F32 = 4


def test_mul_relu_sum_by_hand() -> None:
    x = torch.randn(100, 50)
    w = torch.randn(100, 50, requires_grad=True)
    with SavedBytesCounter() as c:
        y = (x * w).relu().sum()
    # mul saves x (needed for dL/dw; w is not saved since x needs no grad),
    # relu saves its output, sum saves nothing.
    assert c.saved_bytes == 2 * 100 * 50 * F32
    assert c.num_tensors == 2 and c.num_storages == 2 and c.num_skipped == 0
    y.backward()
    assert torch.equal(w.grad, torch.where(x * w > 0, x, torch.zeros_like(x)))


def test_parameters_and_parameter_views_excluded() -> None:
    lin = nn.Linear(50, 20)
    x = torch.randn(8, 50, requires_grad=True)
    with SavedBytesCounter() as c:
        out = lin(x).relu()
    # addmm saves x (for dW) and weight.t() (a view of a Parameter, for dx);
    # relu saves its [8, 20] output.
    assert c.saved_bytes == 8 * 50 * F32 + 8 * 20 * F32
    assert c.num_skipped == 1
    p = nn.Parameter(torch.randn(8, 50))
    with SavedBytesCounter() as c2:
        out2 = x * p  # saves p (for dx) and x (for dp)
    assert c2.saved_bytes == 8 * 50 * F32 and c2.num_skipped == 1
    (out.sum() + out2.sum()).backward()
    assert lin.weight.grad is not None and p.grad is not None


def test_shared_storage_counted_once() -> None:
    x = torch.randn(1000, requires_grad=True)
    with SavedBytesCounter() as c:
        y = x.exp()  # saves result y
        z = (y * y).sum()  # saves y twice
        v = y[:10].sin()  # saves a view of y: same storage
    assert c.num_tensors == 4
    assert c.num_storages == 1
    assert c.saved_bytes == 1000 * F32
    (z + v.sum()).backward()


def test_exclude_buffers() -> None:
    bn = nn.BatchNorm1d(16)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedBytesCounter() as plain:
        bn(x)
    with SavedBytesCounter(exclude=bn.buffers()) as c:
        bn(x)
    # BN saves input, running stats (buffers), save_mean and save_invstd.
    assert plain.saved_bytes - c.saved_bytes == 2 * 16 * F32
    assert c.saved_bytes == 4 * 16 * F32 + 2 * 16 * F32


def test_freed_storage_not_confused_with_new_one() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with SavedBytesCounter() as c:
        y = x.exp()
        del y  # graph and saved result freed; the allocator may reuse the address
        y2 = x.exp()
    assert c.num_storages == 2
    assert c.saved_bytes == 2 * 256 * 256 * F32
    y2.sum().backward()


def test_no_reference_cycle_and_gradients_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SavedBytesCounter() as c:
        out = model(x).square().sum()
    out.backward()
    for p, g in zip(model.parameters(), ref, strict=True):
        assert torch.allclose(p.grad, g)
    assert c.saved_bytes > 0
    # Without backward, dropping the output must free the graph (no cycle).
    big = torch.randn(512, 512, requires_grad=True)
    gc.disable()
    try:
        with SavedBytesCounter():
            e = big.exp()
        r = weakref.ref(e)
        del e
        assert r() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (12_345_678, "12.3 MB"), (2_500_000_000, "2.5 GB"),
     (999_960, "1.0 MB"), (-1500, "-1.5 kB")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (999.2, "1.0 kB"), (1000, "1.0 kB"), (12_345_678, "12.4 MB"),
     (547_430_000, "547.5 MB"), (547_400_000, "547.4 MB"), (999_950_000, "1.0 GB"), (3_032_671_232, "3.1 GB"),
     (-1500, "-1.5 kB")],
)
def test_format_bytes_rounded_up(n: float, text: str) -> None:
    assert format_bytes(n, round_up=True) == text


# -- the counter's two modes -----------------------------------------------------------------------------

def mlp_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.BatchNorm1d(32), nn.Linear(32, 4))


def test_dropping_counts_the_same_bytes_and_keeps_nothing() -> None:
    model, x = mlp_block(), torch.randn(8, 16)
    with SavedBytesCounter(model=model) as kept:
        out = model(x).square().sum()
    with SavedBytesCounter(model=model, dropping=True) as dropped:
        out_dropped = model(x).square().sum()
    assert dropped.saved_bytes == kept.saved_bytes > 0
    assert dropped.num_storages == kept.num_storages and dropped.num_skipped == kept.num_skipped
    out.backward()  # the kept graph back-propagates
    with pytest.raises(UnsupportedError, match=r"dropping=True.*count with dropping=False"):
        out_dropped.backward()


def test_dropping_frees_what_it_counts() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with SavedBytesCounter(dropping=True) as c:
        y = x.exp()  # exp saves its result; the counter keeps no reference to it
    r = weakref.ref(y)
    del y
    assert r() is None
    assert c.saved_bytes == 256 * 256 * F32


def test_model_registry_leaves_out_aliases_of_parameters_and_buffers() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedBytesCounter() as plain:
        (x * lin.weight.detach()[:4]).sum()  # an alias of the weight: neither a Parameter nor a view of one
    with SavedBytesCounter(model=lin) as c:
        (x * lin.weight.detach()[:4]).sum()
    assert plain.saved_bytes == c.saved_bytes + 8 * 8 * F32  # the weight's storage is left out with model=
    assert c.num_skipped == 1


# -- meters and the bytes a step will allocate ----------------------------------------------------------

def test_rss_meter_keeps_the_process_peak_across_resets() -> None:
    meter = meter_for(torch.device("cpu"))
    assert isinstance(meter, RssMeter)
    start = meter.start()
    buf = np.ones(32 * 1024 * 1024 // 8)  # 32 MiB, touched
    assert meter.peak() >= start + 16 * 1024 * 1024
    high = meter.peak()
    del buf
    meter.start()  # resets the kernel's mark ...
    assert meter.lifetime_peak() >= high  # ... but not the process peak


def test_rss_meter_prices_a_trim() -> None:
    """NOTE [ What a trim costs ]: handing pages back and faulting them in costs time per byte; a
    page-sized block measures nothing. Bounds: above 1 ms/GB (the kernel zeroes every faulted page, at
    memory bandwidth no faster than ~100 GB/s) and below 10 s/GB (a page fault costing 40 us)."""
    meter = RssMeter()
    cost = meter.refault_cost()
    assert 1e-12 < cost < 1e-8
    assert meter.refault_cost(100) == 0.0


def test_missing_state_bytes_follow_the_optimizer() -> None:
    model = nn.Linear(10, 10)
    params = sum(p.nbytes for p in model.parameters())
    adam = torch.optim.Adam(model.parameters())
    assert missing_grad_bytes(model) == params
    assert missing_state_bytes(model, adam) == 3 * params  # gradients + two states
    model(torch.randn(2, 10)).sum().backward()
    adam.step()
    assert missing_state_bytes(model, adam) == 0
    adam.zero_grad(set_to_none=True)
    assert missing_state_bytes(model, adam) == params
    assert missing_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1)) == params
    assert missing_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 2 * params
