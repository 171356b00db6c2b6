"""The hybrid reduction: a ReductionSelector calibrates once per size class and caches the choice;
the CPU strategies it chooses between are exact and interchangeable."""

from __future__ import annotations

import json
import time

import pytest
import torch

from daftrain.kernels import cpu, reference
from daftrain.kernels.reduction import ReductionSelector


def as_int(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


class Recorder:
    """A fake strategy: sleeps ``delay`` seconds, counts calls."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    def __call__(self, x: torch.Tensor, group_size: int) -> torch.Tensor:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        return x.new_empty(-(-x.numel() // group_size), 3)


def test_calibrates_once_per_size_class_and_picks_the_faster() -> None:
    slow, fast = Recorder(0.03), Recorder(0.0)
    sel = ReductionSelector("cpu", {"slow": slow, "fast": fast}, threads=lambda: 4, repeats=2, max_synthetic=4096)
    assert sel.choose(100_000, 256, torch.float32) == "fast"
    calls = (slow.calls, fast.calls)
    assert calls == (3, 3)  # one warm-up and two timed runs each, on the synthetic input
    for numel in (100_000, 200_000, 1 << 22):  # same class: many groups of a small size
        assert sel.choose(numel, 256, torch.float32) == "fast"
    assert (slow.calls, fast.calls) == calls
    sel.choose(100_000, 256, torch.float16)  # a new dtype is a new class
    sel.choose(1000, 256, torch.float32)  # fewer groups than threads is a new class
    sel.choose(100_000, 65536, torch.float32)  # huge groups are a new class
    desc = sel.describe()
    json.dumps(desc)
    assert len(desc["choices"]) == 4
    assert {c["strategy"] for c in desc["choices"]} == {"fast"}
    first = desc["choices"][0]
    assert first["groups"] == "many" and first["group_size"] == "small" and first["reason"] == "calibrated"
    assert first["timings_ms"]["slow"] > first["timings_ms"]["fast"]
    assert first["synthetic_groups"] * first["synthetic_group_size"] <= 4096


def test_default_wins_within_margin() -> None:
    a, b = Recorder(0.002), Recorder(0.002)
    sel = ReductionSelector("cpu", {"a": a, "b": b}, repeats=1, margin=0.5, max_synthetic=1024)
    assert sel.choose(10_000, 32, torch.float32) == "a"


def test_forced_and_single_strategy_do_not_calibrate() -> None:
    rec = Recorder(0.0)
    assert ReductionSelector("cpu", {"a": rec, "b": rec}, forced="b").choose(10**6, 32, torch.float32) == "b"
    assert ReductionSelector("cpu", {"a": rec}).choose(10**6, 32, torch.float32) == "a"
    assert ReductionSelector("cpu", {"a": rec, "b": rec}).choose(0, 32, torch.float32) == "a"
    assert rec.calls == 0
    with pytest.raises(ValueError):
        ReductionSelector("cpu", {"a": rec}, forced="zzz")
    with pytest.raises(ValueError):
        ReductionSelector("cpu", {})


def test_reset_forgets() -> None:
    rec = Recorder(0.0)
    sel = ReductionSelector("cpu", {"a": rec, "b": Recorder(0.0)}, repeats=1, max_synthetic=1024)
    sel.choose(10_000, 32, torch.float32)
    sel.reset()
    assert sel.describe()["choices"] == []
    sel.choose(10_000, 32, torch.float32)
    assert rec.calls == 4


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(
    ("numel", "group_size"),
    [(1, 32), (33, 32), (5000, 256), (70_000, 65536), (65536 * 3 + 5, 65536), (100_000, 4096)],
)
def test_cpu_strategies_are_identical(numel: int, group_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen).to(dtype)
    x[numel // 2] = float("nan") if numel > 100 else x[numel // 2]
    ref = as_int(reference.group_minmax(x, group_size))
    assert torch.equal(as_int(cpu.minmax_per_group(x, group_size)), ref)
    assert torch.equal(as_int(cpu.minmax_two_level(x, group_size)), ref)


def test_real_calibration_on_cpu() -> None:
    """The real CPU strategies calibrate and the choice is reported."""
    sel = ReductionSelector("cpu", cpu.STRATEGIES, threads=cpu.threads, max_synthetic=1 << 16)
    choice = sel.choose(1 << 20, 65536, torch.float32)
    assert choice in cpu.STRATEGIES
    (entry,) = sel.describe()["choices"]
    assert set(entry["timings_ms"]) == set(cpu.STRATEGIES)
    assert entry["strategy"] == choice
