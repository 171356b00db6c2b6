"""Probing: the first step of a batch size trains on slices of the batch that grow while they fit and
measures each; the measurements become the planner's ``Profile`` (memory and time per sample, per
segment and per bit-width)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..callbacks import uncompiled
from ..config import CompressionConfig
from ..saved.hooks import compress
from ..saved.op_rules import ExactSavings
from .batching import batch_size, checked_loss, head_copy, shapes_of, slice_copy
from .budgets import BudgetTooSmallError
from .memory import (
    REFAULT_BLOCK_BYTES,
    CudaMeter,
    RssMeter,
    SavedBytesCounter,
    missing_grad_bytes,
    missing_state_bytes,
)
from .optimizer_step import leanest_part_bytes, optimizer_transient_bytes
from .planner import Bits, PlannerConfig, Profile, SegmentProfile, plan_step
from .segments import checkpointing, inplace_activations
from .weight_grads import weight_grads_in_place

__all__ = ["FirstStep", "LossFn", "Prober"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Mode = int | str | None
"""What a probe runs: ``"count"`` (forward only, saved tensors counted and dropped), ``None`` (exact
step), ``"ckpt"`` (exact step, every segment checkpointed) or a bit-width (step under ``compress``)."""


# NOTE [ Measuring the cost model ]
# The planner's quantities (NOTE [ The cost model ] in planner.py) come from the first step's own
# slices of the batch (NOTE [ The planning step trains ]), extrapolated linearly in the slice size m:
# 1. A counting forward (saved tensors counted and dropped, so it holds no activations) on 1 sample (2
#    where one cannot train, e.g. BatchNorm1d) gives the saved bytes per segment and outside every
#    segment, and each segment's input bytes. It trains nothing: buffers and the RNG are restored.
# 2. Exact slices growing in size (NOTE [ Growing probes ]) give the transient working set: the peak
#    above the start, less the saved bytes and the gradients the slice allocated, as a slope per
#    sample (``work_per_sample``) and an intercept (``work_fixed``, the largest over all slices).
#    Where one exact sample would not fit the headroom, slices with every segment checkpointed stand
#    in: what they hold besides their working set (segment inputs, saved bytes outside segments, one
#    segment's saved bytes) is subtracted instead, and the recomputation they paid is removed from
#    their time.
# 3. Only where exact activations would need several micro-batches or checkpointing for the batch,
#    and take more than the kernels' one-time footprint in the exact plan, one slice per allowed
#    bit-width, under ``compress``, gives the compressed saved bytes, working
#    set and time per sample; its intercepts (per-micro-batch time, fixed working set) are the exact
#    slices'. Only where the kernels' one-time footprint (``compression_reserve``) fits too, and after
#    the kernels ran once outside the model, so that their loading is not measured as the model's.
#    That footprint stays in the process, so every later plan has that much less room: compression is
#    measured only where a compressed plan could beat the exact one even so, judged from the exact
#    measurements (saved bytes at ``bits / 32`` of exact, working set and time per micro-batch as exact,
#    time per sample ``compressed_time_factor`` times exact), planned on the room the kernels leave.
# 4. Time and working set: the slope between the second smallest and the largest slice
#    (``per_sample_s``, ``work_per_sample``; never less than half the largest slice's average, a guard
#    against allocator noise, which can flatten the working set of small slices) and the intercept
#    (``fixed_s``, ``work_fixed``); the smallest slice is only used where there are two, since it pays
#    the process's first backward (allocator growth, kernel primitives created), which no later
#    micro-batch pays again, and the widest span left keeps allocator noise out of the slope. A compressed step
#    runs the same forward and backward plus packing and unpacking, so it is never taken to be faster
#    than the exact one, whatever a noisy machine measures.
# 5. ``optimizer_transient`` is the optimizer step's at its leanest (NOTE [ Stepping in parts ]), first
#    estimated (NOTE [ The optimizer step's transient ]), then scaled by what each step measured.

# NOTE [ The planning step trains ]
# Measuring on copies of the batch and then training on it would cost a step several times over
# (every bit-width, growing slices). Instead the slices that measure are the step's own micro-batches:
# each slice's loss is weighted by its share of the batch and its gradients accumulate, so after the
# first step has trained every sample once the gradient is the full batch's, as in any step. The
# samples the slices did not reach (the growth stopped at what fits the headroom) are trained by
# ``BudgetedStep`` under the plan made from the slices' profile. What the first step pays beyond a
# planned step is one counting forward of one sample and the smaller micro-batches of the growth.
# Slices are sized to the whole headroom, like the plan's micro-batches, not to a fraction of it.

# NOTE [ Growing probes ]
# RSS deltas of a 1-sample step are mostly allocator noise; extrapolated to the whole batch they would
# mislead the planner. The slices therefore grow x4 while the per-sample peak measured so far (with
# 30 % to spare) says the next one stays within the headroom and the samples not yet trained.


@dataclass
class _Measurement:
    saved: float = 0.0
    seg_saved: dict[str, float] = dataclasses.field(default_factory=dict)
    seg_input: dict[str, float] = dataclasses.field(default_factory=dict)
    seg_time: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    peak_delta: float = 0.0
    peak: int = 0
    loss: float = 0.0
    held: float = 0.0
    """What the process holds after the slice beyond its start and the gradients it allocated."""


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, Mapping):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


@dataclass(frozen=True)
class FirstStep:
    """What the planning step did: the profile it measured and the training work it has done."""

    profile: Profile
    inplace: bool
    """Whether in-place activations are usable (verified on the first exact slice)."""
    loss: float
    """The weighted loss of the slices trained (each slice's loss times its share of the batch)."""
    trained: int
    """Samples trained: the first ``trained`` samples of the batch; the step trains the rest."""
    peak_bytes: int
    """The highest memory reading during the slices."""
    shapes: frozenset[tuple[tuple[int, ...], ...]] = frozenset()
    """The shapes of the slices trained (``shapes_of``)."""
    held_per_shape: tuple[float, ...] = ()
    """What each exact slice of new shapes left held, the first slice excepted (NOTE [ Memory kept per
    input shape ] in step.py)."""


class Prober:
    """Measures one model's training step for the planner while training it (see NOTE [ Measuring
    the cost model ] and NOTE [ The planning step trains ]).

    Args:
        model, loss_fn, optimizer, segments, config: as given to ``BudgetedStep``.
        compression: the base ``CompressionConfig`` of compressed slices (its ``bits`` is replaced).
        meter: the memory meter of the budget's device (``memory.meter_for``).
        grads_in_place: run every slice under ``weight_grads_in_place`` (as the step runs its micro-batches).
        exact: the context the step's exact plans run under, for the exact slices (``None``: plain PyTorch).
        grad_scaler: scales each slice's loss before its backward (``BudgetedStep``'s ``grad_scaler``).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 segments: Mapping[str, nn.Module], config: PlannerConfig, compression: CompressionConfig,
                 meter: RssMeter | CudaMeter, grads_in_place: bool = False,
                 exact: ExactSavings | None = None, grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.segments, self.config, self.compression, self.meter = segments, config, compression, meter
        self.grads_in_place = grads_in_place
        self.exact, self.grad_scaler = exact, grad_scaler
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # Whether compressed slices ran once: their kernels' one-time footprint is then part of the process.
        self.compression_loaded = False
        self.refault_s_per_byte: float | None = None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled by the step's ``grad_scaler`` where it has one."""
        (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()

    def planning_step(self, batch: Any, budget: int, persistent: int, *, inplace: bool,
                      share: Callable[[Any], float], keep: int = 0) -> FirstStep:
        """Train on slices of ``batch`` that grow while they fit, measuring each (NOTE [ The planning
        step trains ]); leave at least ``keep`` samples untrained for the caller.

        ``share(part)`` is the weight of a slice's loss (its share of what the batch's loss averages
        over). Gradients accumulate in ``.grad``; the optimizer is not stepped.
        """
        B = batch_size(batch)
        usable = max(1, B - keep)
        headroom = (budget - persistent) * self.config.safety
        trained, loss, peak = 0, 0.0, 0
        runs: dict[Mode, list[tuple[int, _Measurement]]] = {}
        shapes: set[tuple[tuple[int, ...], ...]] = set()
        held: list[float] = []

        def train(n: int, mode: Mode, use_inplace: bool) -> _Measurement | None:
            nonlocal trained, loss, peak
            part = slice_copy(batch, trained, n)
            weight = share(part)
            if weight <= 0:  # counts nothing in a mean loss (e.g. every label ignored): nothing to learn
                trained += n
                return None
            key, first_backward = shapes_of(part), not shapes
            m = self._measure(part, mode, weight, use_inplace)
            trained += n  # not before: a slice that raised (in place refused) is trained again
            if key not in shapes and not first_backward and (mode is None or mode == "ckpt"):
                held.append(max(0.0, m.held))  # the process's first backward holds more than its shapes
            shapes.add(key)
            loss += m.loss * weight
            peak = max(peak, m.peak)
            return m

        if self.refault_s_per_byte is None:  # a block within the headroom (NOTE [ What a trim costs ])
            self.refault_s_per_byte = self.meter.refault_cost(int(min(REFAULT_BLOCK_BYTES, max(headroom, 0) / 4)))
        # 1. what one sample saves: counting forwards, leaving no trace (buffers and RNG restored)
        m1, count = self._count(batch)
        exact_one = 1.5 * count.saved + max(count.peak_delta, 0) + 2 * max(count.seg_input.values(), default=0.0)
        mode: Mode = None if exact_one <= headroom else "ckpt"
        # 2. the first slice, in place where autograd allows it
        first: _Measurement | None = None
        while first is None and trained < usable:
            n = min(m1, usable - trained)
            if inplace and mode is None:
                first, inplace = self._train_first_inplace(n, train)
            else:
                first = train(n, mode, False)
            if first is not None:
                runs[mode] = [(n, first)]
        inplace = inplace and mode is None
        # 3. growing slices while they fit (NOTE [ Growing probes ])
        compressed = sorted(b for b in self.config.bits if b is not None)
        if mode in runs:  # where exact plans are not allowed, part of the batch is kept for compressed slices
            reserve = 0 if None in self.config.bits else max(len(compressed), (usable - trained) // 4)
            self._grow(runs[mode], usable - trained - reserve, headroom, lambda n: train(n, mode, inplace))
        # 4. compressed slices, only where exact activations cannot train the batch in one slice
        if compressed and trained < usable and mode in runs and \
                self._compression_may_pay(B, m1, count, runs, budget, persistent):
            free = budget - self.meter.start() - missing_state_bytes(self.model, self.optimizer)
            spare = free * self.config.safety - self.config.compression_reserve
            if self.compression_loaded or spare >= 0.25 * count.saved + max(count.peak_delta, 0):
                self.compression_loaded = True
                self._load_kernels(compressed)
                largest = max(n for n, _ in runs[mode])
                for i, bits in enumerate(compressed):
                    left = usable - trained
                    if left <= 0:
                        break
                    n = max(1, min(largest, left // (len(compressed) - i)))
                    measured = train(n, bits, inplace)
                    if measured is not None:
                        runs[bits] = [(n, measured)]
        if not runs:  # every sample weighed nothing: measure one exact slice, then drop its gradients
            runs[mode] = [(m1, self._measure(head_copy(batch, m1), mode, 0.0, False))]
            self.optimizer.zero_grad(set_to_none=True)
        return FirstStep(self._profile(B, m1, count, runs), inplace, loss, trained, peak, frozenset(shapes),
                         tuple(held))

    # -- the pieces of the planning step ----------------------------------------------------------------
    def _count(self, batch: Any) -> tuple[int, _Measurement]:
        """Saved bytes of one sample (two where one cannot train, e.g. BatchNorm1d), from forwards that
        drop what they save; the first warms the allocator and lazy initialisation."""
        B = batch_size(batch)
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        rng = {"devices": [self.device.index or 0], "device_type": "cuda"} if self.device.type == "cuda" else {
            "devices": []}
        try:
            with torch.random.fork_rng(**rng):
                m1 = 1
                try:
                    self._measure(head_copy(batch, m1), "count", 0.0, False)
                except ValueError:
                    m1 = min(2, B)
                    self._measure(head_copy(batch, m1), "count", 0.0, False)
                return m1, self._measure(head_copy(batch, m1), "count", 0.0, False)
        finally:
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)

    def _train_first_inplace(self, n: int, train: Callable[[int, Mode, bool], _Measurement | None]
                             ) -> tuple[_Measurement | None, bool]:
        """The first exact slice with in-place activations; where autograd refuses them, the slice's
        gradients and buffer updates are undone and it runs again out of place."""
        with inplace_activations(self.model) as affected:
            pass
        if affected == 0:
            return train(n, None, False), False
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        try:
            return train(n, None, True), True
        except RuntimeError as exc:
            if "inplace" not in str(exc) and "in-place" not in str(exc):
                raise
        self.optimizer.zero_grad(set_to_none=True)  # the first slice: nothing else has accumulated
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        return train(n, None, False), False

    def _grow(self, series: list[tuple[int, _Measurement]], left: int, room: float,
              train: Callable[[int], _Measurement | None]) -> None:
        """Train slices growing x4 from the last of ``series`` while the next is predicted to fit
        ``room`` bytes and ``left`` samples (see NOTE [ Growing probes ])."""
        while left > 0:
            m, r = series[-1]
            per_sample = max(r.peak_delta, r.saved, 1.0) / m
            nxt = min(left, 4 * m, int(room / (1.3 * per_sample)))
            if nxt < m + max(1, m // 2):  # too little growth to measure: the plan trains the rest
                return
            left -= nxt
            measured = train(nxt)
            if measured is not None:
                series.append((nxt, measured))

    def _compression_may_pay(self, B: int, m1: int, count: _Measurement,
                             runs: dict[Mode, list[tuple[int, _Measurement]]], budget: int, persistent: int) -> bool:
        """Whether compressed slices are worth training (NOTE [ Measuring the cost model ], 3.): always
        where exact activations are not allowed; otherwise only where exact activations need several
        micro-batches or checkpointing for the batch (only then can compression make the step faster),
        the exact plan's activations are larger than the kernels' one-time footprint
        (``compression_reserve``), and a compressed plan estimated from the exact measurements, on the
        room that footprint leaves, would be faster than the exact plan."""
        if None not in self.config.bits:
            return True
        exact = dataclasses.replace(self.config, bits=(None,))
        try:
            plan = plan_step(self._profile(B, m1, count, runs), budget_bytes=budget, persistent_bytes=persistent,
                             config=exact)
        except BudgetTooSmallError:
            return True
        bound = plan.num_micro_batches > 1 or bool(plan.checkpointed)
        if not bound or plan.predicted_activation_bytes <= self.config.compression_reserve:
            return False
        compressed = tuple(b for b in self.config.bits if b is not None)
        try:
            best = plan_step(_compressed_estimate(self._profile(B, m1, count, runs), compressed,
                                                  self.config.compressed_time_factor),
                             budget_bytes=budget, persistent_bytes=persistent + self.config.compression_reserve,
                             config=dataclasses.replace(self.config, bits=compressed))
        except BudgetTooSmallError:
            return False
        return best.predicted_step_s < plan.predicted_step_s

    def _load_kernels(self, bits: list[int]) -> None:
        """Run every bit-width's kernels once on a small product outside the model: their one-time cost
        (JIT code loaded, thread pools started) is then not measured as the model's."""
        a = torch.randn(256, 256, dtype=torch.float32, device=self.device, requires_grad=True)
        for b in bits:
            with compress(dataclasses.replace(self.compression, bits=b, asynchronous=False, min_numel=1)) as ctx:
                (a @ a).sum().backward()
            ctx.close()

    # -- one measurement ---------------------------------------------------------------------------------
    def _measure(self, part: Any, mode: Mode, weight: float, inplace: bool) -> _Measurement:
        """One slice in ``mode`` (see ``Mode``): forward and, unless counting, backward of ``weight`` times
        its loss, gradients accumulating. Records saved bytes, per-segment saved and input bytes and
        time, wall time, and the peak above the start less the gradients it allocated."""
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
                before, after = uncompiled(functools.partial(pre, name)), uncompiled(functools.partial(post, name))
                handles.append(mod.register_forward_pre_hook(before, with_kwargs=True))
                handles.append(mod.register_forward_hook(after, with_kwargs=True))
        in_place = inplace_activations(self.model) if inplace else contextlib.nullcontext()
        grads_in_place = weight_grads_in_place(self.model) if self.grads_in_place else contextlib.nullcontext()
        # exact slices measure what the step's exact plans run (NOTE [ Exact training with the loss over the head ])
        exact = self.exact if self.exact is not None and not isinstance(ctx, compress) else contextlib.nullcontext()
        start = self.meter.start()
        try:
            t0 = time.perf_counter()
            with grads_in_place:  # over the backward too (NOTE [ Weight gradients accumulated in place ])
                with checkpointing(self.segments, list(self.segments) if mode == "ckpt" else []), in_place, exact, \
                        ctx:
                    loss = checked_loss(self.loss_fn(self.model, part), backward=mode != "count")
                m.saved = saved_now()
                if mode != "count":
                    self.backward(loss * weight)
            m.seconds = time.perf_counter() - t0
            m.loss = float(loss.detach())
            del loss
            m.peak = self.meter.peak()
            m.peak_delta = m.peak - start - (grads if mode != "count" else 0)
            if mode != "count":  # the next slice's start trims as much (NOTE [ Memory kept per input shape ])
                m.held = self.meter.start() - start - (grads - missing_grad_bytes(self.model))
        finally:
            for h in handles:
                h.remove()
            if isinstance(ctx, compress):
                ctx.close()
        return m

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
            series = sorted(runs[key], key=lambda r: r[0])
            # the second smallest and the largest slice: the smallest is the process's first backward
            (ma, a), (mb, g) = series[1] if len(series) >= 3 else series[0], series[-1]
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
            if mb == ma and b is not None and None in per_sample_s:
                # one compressed slice: its intercepts are the exact step's (NOTE [ Measuring ...], 3.)
                work[b] = max(0.0, (rb - work_fixed) / mb)
                fixed_s[b] = fixed_s[None]
                per_sample_s[b] = max(0.0, g.seconds - fixed_s[None]) / mb
                continue
            slope_w = max(0.0, (rb - ra) / (mb - ma)) if mb > ma else max(0.0, rb / mb)
            slope_w = max(slope_w, 0.5 * rb / mb)  # noise guard: never less than half the average
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
        tm, timing = max(runs[None], key=lambda r: r[0]) if None in runs else (m1, count)
        if None in per_sample_s:  # a compressed step is never faster than the exact one (NOTE, 4.)
            for b in per_sample_s:
                per_sample_s[b] = max(per_sample_s[b], per_sample_s[None])
                fixed_s[b] = max(fixed_s[b], fixed_s[None])
        segments = tuple(SegmentProfile(name=n, saved=seg_saved[n], input_bytes=count.seg_input[n] / m1,
                                        forward_s=timing.seg_time.get(n, 0.0) / tm) for n in names)
        return Profile(batch_size=B, segments=segments, outside=outside, work_per_sample=work,
                       work_fixed=max(0.0, work_fixed), per_sample_s=per_sample_s, fixed_s=fixed_s,
                       optimizer_transient=float(optimizer_transient_bytes(self.optimizer,
                                                                           leanest_part_bytes(self.optimizer))),
                       refault_s_per_byte=self.refault_s_per_byte or 0.0)


def _compressed_estimate(profile: Profile, bits: tuple[int, ...], time_factor: float) -> Profile:
    """What compressed slices could measure at best, from an exact profile (NOTE [ Measuring the cost
    model ], 3.): saved bytes at ``b / 32`` of exact, the exact working set and per-micro-batch time,
    ``time_factor`` times the exact time per sample."""
    def scaled(values: dict[Bits, float]) -> dict[Bits, float]:
        return {**values, **{b: values[None] * b / 32 for b in bits}}

    def same(values: dict[Bits, float], factor: float = 1.0) -> dict[Bits, float]:
        return {**values, **{b: values[None] * factor for b in bits}}

    return dataclasses.replace(
        profile, segments=tuple(dataclasses.replace(s, saved=scaled(s.saved)) for s in profile.segments),
        outside=scaled(profile.outside), work_per_sample=same(profile.work_per_sample),
        per_sample_s=same(profile.per_sample_s, time_factor), fixed_s=same(profile.fixed_s))
