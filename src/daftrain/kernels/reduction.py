"""Hybrid per-group min/max reduction: pick the faster strategy at run time, once per size class.

A backend offers several exact strategies for ``group_minmax`` that return identical bytes (the fast
kernels reduce order-preserving integer keys, so the reduction order does not matter), e.g. on CPU:

* ``per_group``  -- one pass per whole group, parallel over runs of groups. Best with many groups:
  no partials, each group is read once while hot in cache (``quantize_pack`` fuses it with the codes).
* ``two_level``  -- tiles *inside* groups reduced in parallel into partials, then a combine per
  group. Best when there are fewer groups than threads, or groups are huge.

Which one wins depends on the machine (threads, caches, memory bandwidth) more than on a formula, so
``ReductionSelector`` measures it: the first time it meets a *size class* -- (device, dtype, thread
count, group-count class relative to the threads, group-size class) -- it times every strategy on a
small synthetic input of that class (at most ``max_synthetic`` values, a few milliseconds), keeps the
fastest and caches the choice; later calls of that class only do a dictionary lookup.

The selector is an explicit object. The kernel registration (``kernels/registry.py``) owns the one
default instance per device; ``describe()`` says what it chose so far (``daftrain env`` prints it).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgumentError

__all__ = ["Choice", "ReductionSelector", "SizeClass"]

Strategy = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class SizeClass:
    """The cache key of a choice."""

    device: str
    dtype: str
    threads: int
    groups: str  # "fewer_than_threads" | "few" | "many"
    group_size: str  # "small" (<= 1024) | "medium" (<= 8192) | "large"


@dataclass
class Choice:
    strategy: str
    reason: str
    timings_ms: dict[str, float] = field(default_factory=dict)
    synthetic: tuple[int, int] = (0, 0)  # (num_groups, group_size) of the calibration input


def _groups_class(num_groups: int, threads: int) -> str:
    if num_groups < threads:
        return "fewer_than_threads"
    if num_groups < 8 * threads:
        return "few"
    return "many"


def _group_size_class(group_size: int) -> str:
    if group_size <= 1024:
        return "small"
    if group_size <= 8192:
        return "medium"
    return "large"


class ReductionSelector:
    """Chooses among exact, interchangeable reduction strategies by timing them once per size class.

    Args:
        device: device type of the tensors the strategies take ("cpu", "cuda").
        strategies: name -> ``fn(flat_contiguous_x, group_size) -> float32 [num_groups, 3]``. The first
            one is the default (used on ties and when there is nothing to choose).
        forced: always return this strategy (tests, benchmarks); no calibration.
        threads: the parallelism the strategies have (thread count, SM count); default
            ``torch.get_num_threads()``.
        sync: called before reading the clock (``torch.cuda.synchronize`` for CUDA).
        repeats: timed runs per strategy (the best counts), after one warm-up run.
        max_synthetic: the most values a calibration input holds.
        margin: a strategy other than the default must be this much faster (relative) to be chosen.
    """

    def __init__(
        self,
        device: str,
        strategies: Mapping[str, Strategy],
        *,
        forced: str | None = None,
        threads: Callable[[], int] | None = None,
        sync: Callable[[], None] | None = None,
        repeats: int = 5,
        max_synthetic: int = 1 << 20,
        margin: float = 0.15,
    ) -> None:
        if not strategies:
            raise InvalidArgumentError("a ReductionSelector needs at least one strategy")
        if forced is not None and forced not in strategies:
            raise InvalidArgumentError(f"unknown strategy {forced!r}; have {sorted(strategies)}")
        self.device = device
        self.strategies = dict(strategies)
        self.default = next(iter(self.strategies))
        self.forced = forced
        self._threads = threads or torch.get_num_threads
        self._sync = sync or (lambda: None)
        self.repeats = max(1, repeats)
        self.max_synthetic = max_synthetic
        self.margin = margin
        self._choices: dict[SizeClass, Choice] = {}
        self._lock = threading.Lock()

    def size_class(self, numel: int, group_size: int, dtype: torch.dtype) -> SizeClass:
        threads = max(1, int(self._threads()))
        num_groups = -(-numel // group_size)
        return SizeClass(
            self.device,
            str(dtype).removeprefix("torch."),
            threads,
            _groups_class(num_groups, threads),
            _group_size_class(group_size),
        )

    def choose(self, numel: int, group_size: int, dtype: torch.dtype) -> str:
        """The strategy for a tensor of ``numel`` values of ``dtype`` in groups of ``group_size``."""
        if self.forced is not None:
            return self.forced
        if len(self.strategies) == 1 or numel == 0:  # nothing to choose between
            return self.default
        cls = self.size_class(numel, group_size, dtype)
        choice = self._choices.get(cls)
        if choice is None:
            with self._lock:
                choice = self._choices.get(cls)
                if choice is None:
                    choice = self._calibrate(cls, numel, group_size, dtype)
                    self._choices[cls] = choice
        return choice.strategy

    def _calibrate(self, cls: SizeClass, numel: int, group_size: int, dtype: torch.dtype) -> Choice:
        num_groups = -(-numel // group_size)
        syn_groups = max(1, min(num_groups, self.max_synthetic // group_size))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(syn_groups * group_size, generator=gen, dtype=torch.float32, device="cpu")
        x = x.to(dtype=dtype, device=self.device)
        timings: dict[str, float] = {}
        for name, fn in self.strategies.items():
            fn(x, group_size)  # warm-up: JIT compile or cache load, page-in
            best = math.inf
            for _ in range(self.repeats):
                self._sync()
                t0 = time.perf_counter()
                fn(x, group_size)
                self._sync()
                best = min(best, time.perf_counter() - t0)
            timings[name] = round(best * 1e3, 4)
        best_name = min(timings, key=timings.__getitem__)
        if best_name != self.default and timings[best_name] > timings[self.default] * (1 - self.margin):
            best_name = self.default
        return Choice(best_name, "calibrated", timings, (syn_groups, group_size))

    def choices(self) -> dict[SizeClass, Choice]:
        with self._lock:
            return dict(self._choices)

    def describe(self) -> dict:
        """What was chosen so far, JSON-serialisable (for ``daftrain env`` / ``kernel_report``)."""
        return {
            "device": self.device,
            "strategies": list(self.strategies),
            "default": self.default,
            "forced": self.forced,
            "choices": [
                {
                    "dtype": cls.dtype,
                    "threads": cls.threads,
                    "groups": cls.groups,
                    "group_size": cls.group_size,
                    "strategy": ch.strategy,
                    "reason": ch.reason,
                    "timings_ms": dict(ch.timings_ms),
                    "synthetic_groups": ch.synthetic[0],
                    "synthetic_group_size": ch.synthetic[1],
                }
                for cls, ch in self.choices().items()
            ],
        }

    def reset(self) -> None:
        """Forget every choice (the next call of each class calibrates again)."""
        with self._lock:
            self._choices.clear()
