"""Tests for RSS measurement and the independent saved-tensor counter."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from daftrain.budget.memory import (
    SavedTensorCounter,
    current_rss_bytes,
    format_bytes,
    peak_rss_bytes,
    reset_peak_rss,
)

F32 = 4


def test_mul_relu_sum_by_hand() -> None:
    x = torch.randn(100, 50)
    w = torch.randn(100, 50, requires_grad=True)
    with SavedTensorCounter() as c:
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
    with SavedTensorCounter() as c:
        out = lin(x).relu()
    # addmm saves x (for dW) and weight.t() (a view of a Parameter, for dx);
    # relu saves its [8, 20] output.
    assert c.saved_bytes == 8 * 50 * F32 + 8 * 20 * F32
    assert c.num_skipped == 1
    p = nn.Parameter(torch.randn(8, 50))
    with SavedTensorCounter() as c2:
        out2 = x * p  # saves p (for dx) and x (for dp)
    assert c2.saved_bytes == 8 * 50 * F32 and c2.num_skipped == 1
    (out.sum() + out2.sum()).backward()
    assert lin.weight.grad is not None and p.grad is not None


def test_shared_storage_counted_once() -> None:
    x = torch.randn(1000, requires_grad=True)
    with SavedTensorCounter() as c:
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
    with SavedTensorCounter() as plain:
        bn(x)
    with SavedTensorCounter(exclude=bn.buffers()) as c:
        bn(x)
    # BN saves input, running stats (buffers), save_mean and save_invstd.
    assert plain.saved_bytes - c.saved_bytes == 2 * 16 * F32
    assert c.saved_bytes == 4 * 16 * F32 + 2 * 16 * F32


def test_freed_storage_not_confused_with_new_one() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with SavedTensorCounter() as c:
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
    with SavedTensorCounter() as c:
        out = model(x).square().sum()
    out.backward()
    for p, g in zip(model.parameters(), ref):
        assert torch.allclose(p.grad, g)
    assert c.saved_bytes > 0
    # Without backward, dropping the output must free the graph (no cycle).
    big = torch.randn(512, 512, requires_grad=True)
    gc.disable()
    try:
        with SavedTensorCounter():
            e = big.exp()
        r = weakref.ref(e)
        del e
        assert r() is None
    finally:
        gc.enable()


def test_peak_rss_monotonic_and_reset() -> None:
    assert current_rss_bytes() > 0
    first = peak_rss_bytes()
    assert first >= current_rss_bytes() > 0
    buf = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
    grown = peak_rss_bytes()
    assert grown >= first
    assert grown >= current_rss_bytes()
    assert peak_rss_bytes() >= grown  # never decreases without a reset
    del buf
    ok = reset_peak_rss()
    assert isinstance(ok, bool)
    if ok:
        # The 64 MiB buffer (mmap'd by glibc) is gone, so the new peak is lower.
        assert peak_rss_bytes() < grown - 32 * 1024 * 1024
    else:
        pytest.skip("this kernel/container does not allow resetting VmHWM")


def test_reset_returns_false_without_clear_refs(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import daftrain.budget.memory as memory

    monkeypatch.setattr(memory, "_PROC_CLEAR_REFS", tmp_path / "no" / "clear_refs")
    assert memory.reset_peak_rss() is False


def test_peak_rss_fallback_without_proc(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import daftrain.budget.memory as memory

    monkeypatch.setattr(memory, "_PROC_STATUS", tmp_path / "missing")
    assert memory.peak_rss_bytes() > 0  # getrusage fallback


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (12_345_678, "12.3 MB"), (2_500_000_000, "2.5 GB"),
     (999_960, "1.0 MB"), (-1500, "-1.5 kB")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
