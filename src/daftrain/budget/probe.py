"""Probing: measure a training step on small slices of the first batch and turn the measurements into
the planner's ``Profile`` (its memory and time per sample, per segment and per bit-width)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import CompressionConfig
from ..saved.hooks import compress
from .batching import batch_size, head_copy
from .memory import CudaMeter, RssMeter, SavedBytesCounter, missing_grad_bytes, missing_state_bytes
from .planner import PlannerConfig, Profile, SegmentProfile
from .segments import checkpointing, inplace_activations

__all__ = ["LossFn", "Prober"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Mode = int | str | None
"""What a probe runs: ``"count"`` (forward only, saved tensors counted and dropped), ``None`` (exact
step), ``"ckpt"`` (exact step, every segment checkpointed) or a bit-width (step under ``compress``)."""


# NOTE [ Measuring the cost model ]
# The planner's quantities (NOTE [ The cost model ] in planner.py) come from forward+backward runs on
# copies of the first samples of the first batch, extrapolated linearly in the slice size m:
# 1. A counting forward (saved tensors counted and dropped, so it holds no activations) on 1 sample (2
#    where one cannot train, e.g. BatchNorm1d) gives the saved bytes per segment and outside every
#    segment, and each segment's input bytes.
# 2. An exact step on growing slices (NOTE [ Growing probes ]) gives the transient working set: the
#    peak above the start, less the saved bytes and the gradients the step allocates, as a slope per
#    sample (``work_per_sample``) and an intercept (``work_fixed``, the largest over all modes). Where
#    one exact sample would not fit the headroom, a step with every segment checkpointed stands in:
#    what it holds besides its working set (segment inputs, saved bytes outside segments, one
#    segment's saved bytes) is subtracted instead, and the recomputation it paid is removed from its
#    time.
# 3. The same at every allowed bit-width, under ``compress``, gives the compressed saved bytes and
#    working sets; only where the kernels' one-time footprint (``compression_reserve``) fits too.
# 4. Time: the slope between the smallest and the largest slice (``per_sample_s``, never less than
#    half the average: a noise guard) and the intercept per micro-batch (``fixed_s``). A compressed step
#    runs the same forward and backward plus packing and unpacking, so it is never taken to be faster
#    than the exact one, whatever a noisy machine measures.
# 5. ``optimizer_transient`` starts at three times the largest parameter; ``BudgetedStep`` replaces it
#    with the measured optimizer-step peak after its first step.
# Model buffers (BatchNorm statistics) and the RNG state are restored afterwards and gradients
# dropped: probing leaves no trace in training.

# NOTE [ Growing probes ]
# RSS deltas of a 1-sample step are mostly allocator noise; extrapolated to the whole batch they would
# mislead the planner. A probe therefore grows the slice x4 while the per-sample peak measured so far
# says the next slice stays within ``room`` (a fraction of the headroom) and ``cap`` samples.


@dataclass
class _Measurement:
    saved: float = 0.0
    seg_saved: dict[str, float] = dataclasses.field(default_factory=dict)
    seg_input: dict[str, float] = dataclasses.field(default_factory=dict)
    seg_time: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    peak_delta: float = 0.0


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, Mapping):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class Prober:
    """Measures one model's training step for the planner (see NOTE [ Measuring the cost model ]).

    Args:
        model, loss_fn, optimizer, segments, config: as given to ``BudgetedStep``.
        compression: the base ``CompressionConfig`` of compressed probes (its ``bits`` is replaced).
        meter: the memory meter of the budget's device (``memory.meter_for``).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 segments: Mapping[str, nn.Module], config: PlannerConfig, compression: CompressionConfig,
                 meter: RssMeter | CudaMeter) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.segments, self.config, self.compression, self.meter = segments, config, compression, meter
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # Whether compressed probes ran once: their kernels' one-time footprint is then part of the process.
        self.compression_loaded = False

    def probe(self, batch: Any, budget: int, persistent: int, *, inplace: bool) -> tuple[Profile, bool]:
        """Measure the step on small slices of ``batch``; return the profile and whether in-place
        activations are usable (checked only when ``inplace`` and an exact sample fits)."""
        B = batch_size(batch)
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        headroom = (budget - persistent) * self.config.safety
        room = self.config.probe_fraction * headroom
        cap = max(1, int(B * self.config.probe_fraction))
        runs: dict[Mode, list[tuple[int, _Measurement]]] = {}
        try:
            rng = {"devices": [self.device.index or 0], "device_type": "cuda"} if self.device.type == "cuda" else {
                "devices": []}
            with torch.random.fork_rng(**rng):
                m1 = 1
                try:
                    self._measure(head_copy(batch, m1), "count")  # warm-up (allocator, lazy initialisation)
                except ValueError:  # e.g. BatchNorm1d cannot train on one sample
                    m1 = min(2, B)
                    self._measure(head_copy(batch, m1), "count")
                count = self._measure(head_copy(batch, m1), "count")
                # The exact step runs only if one slice of it is predicted to fit; otherwise the exact
                # figures come from a step with every segment checkpointed (boundaries + one block).
                exact_one = 1.5 * count.saved + max(count.peak_delta, 0) + 2 * max(count.seg_input.values(),
                                                                                    default=0.0)
                if exact_one <= headroom:
                    runs[None] = self._grow(batch, None, self._measure(head_copy(batch, m1), None), m1, cap, room)
                else:
                    runs["ckpt"] = [(m1, self._measure(head_copy(batch, m1), "ckpt"))]
                if inplace:
                    inplace = exact_one <= headroom and self._verify_inplace(head_copy(batch, m1))
                # Compression runs only if its kernels' one-time footprint fits besides the probe.
                free = budget - self.meter.start() - missing_state_bytes(self.model, self.optimizer)
                spare = free * self.config.safety - self.config.compression_reserve
                compressed = sorted(b for b in self.config.bits if b is not None)
                if compressed and (self.compression_loaded or spare >= 0.25 * count.saved + max(count.peak_delta, 0)):
                    self.compression_loaded = True
                    warm = head_copy(batch, min(4, B))
                    for bits in compressed:  # warm-up: kernel compilation and thread pools grow RSS once
                        self._measure(warm, bits)
                    free = budget - self.meter.start() - missing_state_bytes(self.model, self.optimizer)
                    room = min(room, self.config.probe_fraction * free * self.config.safety)
                    for bits in compressed:
                        runs[bits] = self._grow(batch, bits, self._measure(head_copy(batch, m1), bits), m1, cap, room)
        finally:
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)
            self.optimizer.zero_grad(set_to_none=True)
        return self._profile(B, m1, count, runs), inplace

    # -- one measurement ---------------------------------------------------------------------------------
    def _measure(self, part: Any, mode: Mode) -> _Measurement:
        """One probe on ``part`` in ``mode`` (see ``Mode``): saved bytes, per-segment saved and input
        bytes and time, wall time, and the peak above the start less the gradients it allocated."""
        self.optimizer.zero_grad(set_to_none=True)
        grads = missing_grad_bytes(self.model)
        ctx: Any
        if mode == "count" or mode is None or mode == "ckpt":
            ctx = SavedBytesCounter(model=self.model, dropping=mode == "count")
            saved_now: Callable[[], float] = lambda: ctx.saved_bytes  # noqa: E731
        else:
            ctx = compress(dataclasses.replace(self.compression, bits=mode, asynchronous=False), model=self.model)
            saved_now = lambda: ctx.stats.stored_bytes  # noqa: E731
        m = _Measurement()
        stack: list[tuple[float, float]] = []

        def pre(name: str, _mod: nn.Module, args: Any, kwargs: Any) -> None:
            m.seg_input[name] = m.seg_input.get(name, 0.0) + _nbytes(args) + _nbytes(kwargs)
            stack.append((saved_now(), time.perf_counter()))

        def post(name: str, _mod: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
            b0, t0 = stack.pop()
            m.seg_saved[name] = m.seg_saved.get(name, 0.0) + saved_now() - b0
            m.seg_time[name] = m.seg_time.get(name, 0.0) + time.perf_counter() - t0

        handles = []
        if mode != "ckpt":
            for name, mod in self.segments.items():
                handles.append(mod.register_forward_pre_hook(functools.partial(pre, name), with_kwargs=True))
                handles.append(mod.register_forward_hook(functools.partial(post, name), with_kwargs=True))
        start = self.meter.start()
        try:
            t0 = time.perf_counter()
            with checkpointing(self.segments, list(self.segments) if mode == "ckpt" else []), ctx:
                loss = self.loss_fn(self.model, part)
            m.saved = saved_now()
            if mode != "count":
                loss.backward()
            m.seconds = time.perf_counter() - t0
            del loss
            m.peak_delta = self.meter.peak() - start - (grads if mode != "count" else 0)
        finally:
            for h in handles:
                h.remove()
            if isinstance(ctx, compress):
                ctx.close()
            self.optimizer.zero_grad(set_to_none=True)
        return m

    def _verify_inplace(self, part: Any) -> bool:
        """One exact step with in-place activations; autograd raises where they are not allowed."""
        with inplace_activations(self.model) as n:
            if n == 0:
                return False
            try:
                self.loss_fn(self.model, part).backward()
            except RuntimeError as exc:
                if "inplace" not in str(exc) and "in-place" not in str(exc):
                    raise
                return False
            finally:
                self.optimizer.zero_grad(set_to_none=True)
        return True

    def _grow(self, batch: Any, mode: Mode, first: _Measurement, m1: int, cap: int,
              room: float) -> list[tuple[int, _Measurement]]:
        """Measure ``mode`` on slices growing from ``m1`` while they fit ``room`` bytes and ``cap``
        samples (see NOTE [ Growing probes ])."""
        runs = [(m1, first)]
        while True:
            m, r = runs[-1]
            per_sample = max(r.peak_delta, r.saved, 1.0) / m
            nxt = min(cap, 4 * m, int(room / (1.3 * per_sample)))
            if nxt < m + max(1, m // 2):
                return runs
            runs.append((nxt, self._measure(head_copy(batch, nxt), mode)))

    # -- the profile -----------------------------------------------------------------------------------
    def _profile(self, B: int, m1: int, count: _Measurement,
                 runs: dict[Mode, list[tuple[int, _Measurement]]]) -> Profile:
        """The planner's profile from the measurements (see NOTE [ Measuring the cost model ])."""
        names = [n for n in self.segments if n in count.seg_saved]
        options: list[int | None] = [b for b in runs if b != "ckpt"]  # type: ignore[misc]
        if "ckpt" in runs:
            options.insert(0, None)
        seg_saved: dict[str, dict[int | None, float]] = {n: {None: count.seg_saved[n] / m1} for n in names}
        outside: dict[int | None, float] = {None: max(0.0, count.saved - sum(count.seg_saved[n] for n in names)) / m1}
        work: dict[int | None, float] = {}
        per_sample_s: dict[int | None, float] = {}
        fixed_s: dict[int | None, float] = {}
        work_fixed = 0.0
        for b in options:
            key = "ckpt" if b is None and "ckpt" in runs else b
            series = runs[key]
            (ma, a), (mb, g) = series[0], series[-1]
            if b is not None:
                for n in names:
                    seg_saved[n][b] = g.seg_saved.get(n, 0.0) / mb
                outside[b] = max(0.0, g.saved - sum(g.seg_saved.get(n, 0.0) for n in names)) / mb
            if key == "ckpt":  # what the checkpointed step holds besides its transient working set
                held = sum(count.seg_input[n] for n in names) + count.saved - sum(count.seg_saved[n] for n in names) \
                    + max((count.seg_saved[n] for n in names), default=0.0)
                ra, rb = a.peak_delta - held / m1 * ma, g.peak_delta - held / m1 * mb
            else:
                ra, rb = a.peak_delta - a.saved, g.peak_delta - g.saved
            slope_w = max(0.0, (rb - ra) / (mb - ma)) if mb > ma else max(0.0, rb / mb)
            work[b] = slope_w
            work_fixed = max(work_fixed, rb - slope_w * mb, ra - slope_w * ma)
            slope = (g.seconds - a.seconds) / (mb - ma) if mb > ma else g.seconds / mb
            slope = max(slope, g.seconds / mb * 0.5)  # noise guard: never less than half the average
            fixed_s[b] = max(0.0, g.seconds - slope * mb)
            if key == "ckpt":  # remove the recomputation the checkpointed probe paid
                slope = max(slope * 0.5, slope - sum(count.seg_time[n] for n in names) / m1)
            per_sample_s[b] = slope
        # Recompute cost per sample from the largest exact slice when there is one (a 1-sample forward
        # is dominated by per-call overhead).
        tm, timing = runs[None][-1] if None in runs else (m1, count)
        if None in per_sample_s:  # a compressed step is never faster than the exact one (NOTE, 4.)
            for b in per_sample_s:
                per_sample_s[b] = max(per_sample_s[b], per_sample_s[None])
                fixed_s[b] = max(fixed_s[b], fixed_s[None])
        segments = tuple(SegmentProfile(name=n, saved=seg_saved[n], input_bytes=count.seg_input[n] / m1,
                                        forward_s=timing.seg_time.get(n, 0.0) / tm) for n in names)
        largest = max((p.nbytes for p in self.model.parameters() if p.requires_grad), default=0)
        return Profile(batch_size=B, segments=segments, outside=outside, work_per_sample=work,
                       work_fixed=max(0.0, work_fixed), per_sample_s=per_sample_s, fixed_s=fixed_s,
                       optimizer_transient=float(3 * largest))
