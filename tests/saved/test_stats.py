"""CompressionStats: the process's peak memory read with ``ctx.stats``, and the summary that shows it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import daftrain
from daftrain import CompressionStats
from daftrain.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

BIG = 256 << 20  # bytes: far above the noise of a small step's RSS


def _step(ctx: daftrain.compress, model: nn.Module) -> None:
    with ctx:
        loss = model(torch.randn(64, 128)).square().mean()
    loss.backward()


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8))


def test_stats_read_after_backward_hold_the_peak_of_the_step(model: nn.Module) -> None:
    ctx = daftrain.compress(bits=2, model=model)
    _step(ctx, model)
    assert reset_peak_rss(), "this test needs /proc/self/clear_refs to reset the process peak"
    before = current_rss_bytes()
    big = torch.ones(BIG // 4)  # every page written: resident
    del big
    stats = ctx.stats
    after = peak_rss_bytes()
    assert before + 0.9 * BIG <= stats.peak_rss_bytes <= after
    assert stats.stored_bytes > 0  # the saved bytes sit beside it, in the same object


def test_each_read_of_stats_reads_the_peak_again(model: nn.Module) -> None:
    ctx = daftrain.compress(bits=2, model=model)
    _step(ctx, model)
    assert reset_peak_rss()
    first = ctx.stats.peak_rss_bytes
    big = torch.ones(BIG // 4)
    del big
    assert ctx.stats.peak_rss_bytes >= first + 0.9 * BIG


def test_summary_shows_the_peak_next_to_the_saved_bytes(model: nn.Module) -> None:
    ctx = daftrain.compress(bits=2, model=model)
    _step(ctx, model)
    stats = ctx.stats
    text = stats.summary()
    assert f"MB -> {stats.stored_bytes / 1e6:.2f} MB" in text
    assert text.endswith(f"; process peak: RSS {stats.peak_rss_bytes / 1e6:.0f} MB")
    assert stats.peak_rss_bytes > 0


def test_stats_never_read_show_no_peak() -> None:
    stats = CompressionStats()
    assert (stats.peak_rss_bytes, stats.peak_cuda_allocated_bytes, stats.peak_cuda_reserved_bytes) == (0, 0, 0)
    assert "process peak" not in stats.summary()


def test_cuda_peaks_are_read_only_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: pytest.fail("read without CUDA"))
    stats = CompressionStats()
    stats.read_peak_memory()
    assert stats.peak_rss_bytes > 0 and stats.peak_cuda_allocated_bytes == 0
    assert "CUDA" not in stats.summary()

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 123_000_000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 456_000_000)
    stats.read_peak_memory()
    assert (stats.peak_cuda_allocated_bytes, stats.peak_cuda_reserved_bytes) == (123_000_000, 456_000_000)
    assert stats.summary().endswith(", CUDA 123 MB allocated (456 MB reserved)")
