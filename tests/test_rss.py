"""rss.py: the process's resident memory now, its peak, and resetting the peak."""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
import pytest
import torch

from daftrain import rss
from daftrain.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_peak_rss_monotonic_and_reset() -> None:
    # The current RSS is read before the peak each time: RSS may grow by a page between two reads.
    now = current_rss_bytes()
    first = peak_rss_bytes()
    assert first >= now > 0
    buf = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
    now = current_rss_bytes()
    grown = peak_rss_bytes()
    assert grown >= first
    assert grown >= now
    assert peak_rss_bytes() >= grown  # never decreases without a reset
    del buf
    ok = reset_peak_rss()
    assert isinstance(ok, bool)
    if ok:
        # The 64 MiB buffer (mmap'd by glibc) is gone, so the new peak is lower.
        assert peak_rss_bytes() < grown - 32 * 1024 * 1024
    else:
        pytest.skip("this kernel/container does not allow resetting VmHWM")


def test_process_peak_is_the_kernels_high_water_mark() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    big = torch.ones(64 << 20)  # 256 MiB, every page written
    del big
    peak = peak_rss_bytes()
    assert before + (230 << 20) <= peak <= _status_bytes("VmHWM")


def test_reset_returns_false_without_clear_refs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rss, "_PROC_CLEAR_REFS", tmp_path / "no" / "clear_refs")
    assert reset_peak_rss() is False


def test_without_proc_the_peak_is_ru_maxrss(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rss, "_PROC_STATUS", tmp_path / "missing")
    expected = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak_rss_bytes() == expected
