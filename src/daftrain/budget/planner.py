"""The Sage planner: a cost model from one measured step, and the fastest plan that fits a budget.

A plan fixes three knobs for one training step:

* ``num_micro_batches`` (gradient accumulation over equal slices of the batch),
* which segments (blocks of the model) are checkpointed (non-reentrant),
* ``bits``: how saved activations are stored (``daftrain.compress`` at 8/4/2 bits, or ``None`` for
  exact), those of a checkpointed segment's recomputation in backward included (``daftrain.checkpoint``).

The search is exhaustive over bits and over checkpoint sets ordered by Sage's criterion (bytes freed
per second of recompute, greedy prefixes); for each, the largest micro-batch that fits follows in
closed form since memory is linear in ``m`` (NOTE [ The cost model ]).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from .budgets import BudgetTooSmallError
from .memory import format_bytes

__all__ = ["Lever", "Plan", "PlannerConfig", "Profile", "SegmentProfile", "accumulation_time", "lever", "plan_step"]

Bits = int | None
Lever = tuple[Bits, bool]
"""A bit-width, and whether segments are checkpointed: what a time correction is kept for."""


def lever(bits: Bits, checkpointed: Collection[str]) -> Lever:
    """The lever of a plan with ``bits`` and ``checkpointed`` segments."""
    return bits, bool(checkpointed)
_ALLOWED_BITS = (None, 8, 4, 2, 1)

# NOTE [ The cost model ]
# Every quantity is per sample or per micro-batch, measured by probing (NOTE [ Measuring the cost
# model ] in probe.py), and linear in the micro-batch size ``m``:
# 1. Memory. ``peak = persistent + alpha * act(m)`` where ``persistent`` is what the process holds at
#    the start of the step (RSS, plus gradients and optimizer state not allocated yet) and
#    ``act(m) = work_fixed + m * (outside[b] + sum_{i not ckpt} saved_i[b] + sum_{i ckpt} input_i
#    + max_{i ckpt} saved_i[b] + work[b])``: saved activations outside segments, inside
#    un-checkpointed segments (at the chosen bits), the inputs checkpoint keeps (exact), the one segment
#    that is recomputed during its backward (stored at the chosen bits too, NOTE [ Compressed
#    recomputation ] in saved/checkpoint.py), and the measured transient working set of
#    forward/backward beyond what is saved. The optimizer step peaks separately:
#    ``persistent + optimizer_transient``. A plan fits when both stay within ``persistent + safety *
#    (budget - persistent)``.
# 2. Time. ``T = k * fixed_s[b] + B * (per_sample_s[b] + sum_{i ckpt} forward_i)``: per-micro-batch
#    overhead, per-sample forward+backward at those bits, one extra forward for every checkpointed
#    segment (its recomputation compresses what the forward no longer does).
# 3. Trims. A planned step returns the allocator's free memory before a micro-batch, or its backward,
#    when what the process holds leaves it less room than the model gives it (NOTE [ Metering a planned
#    step ] in step.py), and every byte returned is faulted in again by the next allocations. What the
#    previous micro-batch freed and the allocator kept (glibc reuses it only in part) is the share
#    ``kept`` (``Profile.freed_kept``) of its activation bytes: 1 until steps measure it (``BudgetedStep``:
#    the largest of its last three plans that ran without a trim, measured as the phase's peak over its
#    first micro-batch's, less one; a plan that had to trim counts as 1). So a plan of several
#    micro-batches with ``(1 + kept) act(m)`` within the headroom never trims, and its peak is modelled
#    as that; a larger one trims about twice per micro-batch after the first: ``T += (2k - 1) *
#    refault_s_per_byte * act(m)``, and its peak is ``act(m)``. A plan whose kept share was
#    underestimated stays under its budget all the same: its micro-batches trim where the room runs
#    short (NOTE [ Metering a planned step ]). For each bit-width and checkpoint set the search weighs the largest
#    micro-batch that fits against the largest that never trims (on a CPU, where small micro-batches
#    cost little, usually the latter).
# 4. Time is corrected from measurement too: ``time_scale`` multiplies the predicted time of each
#    lever, a bit-width with or without checkpointing (``BudgetedStep`` passes the median ratio of
#    measured to predicted time over the lever's last three steps, and for one not run yet that of the
#    lever run last, so that a loaded machine slows every plan alike). The probe times a bit-width on a
#    few samples and a recomputation from one sample's forward; what decides between levers afterwards
#    is the steps' own time.
# 5. ``alpha`` (>= 1) corrects the activation term from the measured peaks: the largest ratio of
#    measured to predicted over the last three planned steps (``BudgetedStep``; of a step, the larger of
#    its first micro-batch against its activations and its whole phase against the footprint of 3.), so an
#    underestimate is corrected at the next step and the correction goes away once three steps agree
#    with the model again (a one-way ratchet kept a plan lean for ever after one tight step). It does
#    not go below 1: a measurement at one micro-batch size says little about the split between the
#    fixed and per-sample terms, and scaling both down at once went over budget at larger ones.


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner may choose, and how much slack it keeps.

    Example::

        PlannerConfig(bits=(None,), checkpoint=True)   # exact activations only
    """

    bits: tuple[Bits, ...] = (None, 8, 4, 2)
    """Activation precisions to choose from; ``None`` keeps saved activations exact. Compression is
    lossy (stochastic rounding, unbiased): pass ``(None,)`` to forbid it."""
    checkpoint: bool = True
    """Allow checkpointing segments."""
    safety: float = 0.9
    """Plans use at most this fraction of the headroom (budget minus what the process holds)."""
    prefer_exact_within: float = 0.05
    """Among plans at most this much slower than the fastest, take the one with the most bits, then the one
    with the fewest checkpointed segments."""
    compression_reserve: int = 200_000_000
    """Bytes the compression kernels and the planning step's compressed slices add to the process, for
    good (on CPU: numba's compiled code and LLVM, loaded from numba's cache; docs/budget.md has the
    measured footprint). Compressed plans are measured only where the headroom holds this much besides
    the measuring slice and the exact plan's activations are larger than it."""
    max_alpha: float = 4.0
    """Upper bound on the measured correction of the activation-memory model (its lower bound is 1)."""
    compressed_time_factor: float = 1.1
    """The least a compressed step is taken to cost against the exact one before compression was
    measured: what decides whether loading the kernels (``compression_reserve``, held for good) can pay
    (NOTE [ Measuring the cost model ], 3.; measured step times in docs/memory.md)."""
    tighten_below: int = 64 << 20
    """Where the budget leaves less room than this many bytes above what the process holds, a CPU step
    fixes glibc's mmap threshold (``BudgetedStep(tune_allocator=None)``, the default; NOTE [ The allocator
    as a lever ] in step.py): glibc's own threshold keeps freed blocks of up to 32 MiB, so below two of
    them what one micro-batch's transients leave held varies as much as the room."""

    def __post_init__(self) -> None:
        if not isinstance(self.bits, tuple) or not self.bits:
            raise InvalidArgumentError(f"PlannerConfig.bits must be a non-empty tuple, e.g. (None, 8, 4, 2), got "
                                       f"{self.bits!r}")
        for b in self.bits:
            if b not in _ALLOWED_BITS or isinstance(b, bool):
                raise InvalidArgumentError(f"PlannerConfig.bits entries must be None, 8, 4, 2 or 1, got {b!r}")
        if not isinstance(self.checkpoint, bool):
            raise ArgumentTypeError(f"PlannerConfig.checkpoint must be a bool, got {type(self.checkpoint).__name__}")
        for name in ("safety", "prefer_exact_within", "max_alpha", "compressed_time_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ArgumentTypeError(f"PlannerConfig.{name} must be a number, got {type(value).__name__}")
        if not 0 < self.safety <= 1:
            raise InvalidArgumentError(f"PlannerConfig.safety must be in (0, 1], e.g. 0.9, got {self.safety!r}")
        if not 0 <= self.prefer_exact_within < 1:
            raise InvalidArgumentError(f"PlannerConfig.prefer_exact_within must be in [0, 1), e.g. 0.05, got "
                                       f"{self.prefer_exact_within!r}")
        if isinstance(self.compression_reserve, bool) or not isinstance(self.compression_reserve, int) or \
                self.compression_reserve < 0:
            raise InvalidArgumentError(f"PlannerConfig.compression_reserve must be a non-negative int of bytes, got "
                                       f"{self.compression_reserve!r}")
        if not self.max_alpha >= 1:
            raise InvalidArgumentError(f"PlannerConfig.max_alpha must be >= 1, e.g. 4.0, got {self.max_alpha!r}")
        if isinstance(self.tighten_below, bool) or not isinstance(self.tighten_below, int) or self.tighten_below < 0:
            raise InvalidArgumentError(f"PlannerConfig.tighten_below must be a non-negative int of bytes, e.g. "
                                       f"64 << 20, got {self.tighten_below!r}")
        if not self.compressed_time_factor >= 1:
            raise InvalidArgumentError(f"PlannerConfig.compressed_time_factor must be >= 1, e.g. 1.1, got "
                                       f"{self.compressed_time_factor!r}")


@dataclass(frozen=True)
class SegmentProfile:
    """One checkpointable block, measured per sample."""

    name: str
    saved: dict[Bits, float]
    """Bytes saved for backward inside the block, per sample, at each precision."""
    input_bytes: float
    """Bytes per sample of the block's tensor inputs (what checkpoint keeps)."""
    forward_s: float
    """Forward time per sample (the cost of recomputing it)."""


@dataclass(frozen=True)
class Profile:
    """Everything the planner knows about one step, from measurement (see NOTE [ The cost model ])."""

    batch_size: int
    segments: tuple[SegmentProfile, ...]
    outside: dict[Bits, float]
    """Saved bytes per sample outside every segment (stem, head, loss), at each precision."""
    work_per_sample: dict[Bits, float]
    """Transient bytes per sample beyond the saved ones (activation gradients, temporaries)."""
    work_fixed: float
    """Transient bytes independent of the micro-batch size."""
    per_sample_s: dict[Bits, float]
    """Forward + backward seconds per sample, nothing checkpointed."""
    fixed_s: dict[Bits, float]
    """Seconds per micro-batch independent of its size."""
    optimizer_transient: float
    """Bytes above ``persistent`` that ``optimizer.step`` needs."""
    refault_s_per_byte: float = 0.0
    """Seconds per byte a trim costs: handing memory back to the OS and faulting it in again (NOTE [ The
    cost model ], 3.); 0 where releasing cached memory costs no price per byte."""
    freed_kept: float = 1.0
    """The share of a micro-batch's activations the allocator still holds while the next one peaks (NOTE
    [ The cost model ], 3.): 1 until steps measure it."""

    @property
    def bits_options(self) -> tuple[Bits, ...]:
        return tuple(self.per_sample_s)


@dataclass(frozen=True)
class Plan:
    """One step's plan; ``print(plan)`` shows it as a table."""

    budget_bytes: int
    persistent_bytes: int
    batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    checkpointed: tuple[str, ...]
    bits: Bits
    predicted_peak_bytes: int
    predicted_step_s: float
    alpha: float
    segments: tuple[SegmentProfile, ...] = field(repr=False, default=())
    predicted_activation_bytes: int = 0
    """The accumulation phase's share of the peak (activations and transients, alpha included; twice one
    micro-batch's for a plan that does not trim, NOTE [ The cost model ], 3.)."""

    def __str__(self) -> str:
        bits = "exact" if self.bits is None else f"{self.bits}-bit"
        head = (
            f"Plan: batch {self.batch_size} = {self.num_micro_batches} x micro-batch <= {self.micro_batch_size}, "
            f"activations {bits}, {len(self.checkpointed)}/{len(self.segments)} segments checkpointed\n"
            f"  budget {format_bytes(self.budget_bytes)}, held {format_bytes(self.persistent_bytes)}, "
            f"predicted peak {format_bytes(self.predicted_peak_bytes)} (alpha {self.alpha:.2f}), "
            f"predicted step {self.predicted_step_s:.3f} s\n"
        )
        rows = [f"  {'segment':<28} {'saved/sample':>13} {'input/sample':>13} {'fwd ms/sample':>14}  checkpoint"]
        ck = set(self.checkpointed)
        for s in self.segments:
            saved = s.saved.get(self.bits if s.name not in ck else None, s.saved[None])
            rows.append(f"  {s.name:<28} {format_bytes(saved):>13} {format_bytes(s.input_bytes):>13} "
                        f"{1e3 * s.forward_s:>14.2f}  {'yes' if s.name in ck else 'no'}")
        return head + "\n".join(rows)


def _headroom(budget_bytes: int, persistent_bytes: int, config: PlannerConfig) -> float:
    """What plans may use: ``safety`` of the budget above what the process holds."""
    return (budget_bytes - persistent_bytes) * config.safety


def _smallest_budget(need: float, persistent_bytes: int, config: PlannerConfig) -> int:
    """The smallest whole number of bytes whose headroom holds ``need``, checked with the planner's own
    float arithmetic (``ceil(need / safety)`` alone can land a byte short of it)."""
    required = persistent_bytes + math.ceil(need / config.safety)
    while _headroom(required, persistent_bytes, config) < need:
        required += 1
    while required > persistent_bytes and _headroom(required - 1, persistent_bytes, config) >= need:
        required -= 1
    return required


def _bits_rank(b: Bits) -> int:
    return 64 if b is None else b


def _records_per_sample(profile: Profile, bits: Bits, ckpt: frozenset[str]) -> float:
    """What the forward stores per sample at ``bits``: saved outside the segments and in those not
    checkpointed (NOTE [ The cost model ], 1.)."""
    return profile.outside[bits] + sum(s.saved[bits] for s in profile.segments if s.name not in ckpt)


def _activation_per_sample(profile: Profile, bits: Bits, ckpt: frozenset[str]) -> float:
    checkpointed = [s for s in profile.segments if s.name in ckpt]
    recompute_peak = max((s.saved[bits] for s in checkpointed), default=0.0)
    return (_records_per_sample(profile, bits, ckpt) + profile.work_per_sample[bits]
            + sum(s.input_bytes for s in checkpointed) + recompute_peak)


def _step_time(profile: Profile, bits: Bits, ckpt: frozenset[str], k: int, samples: int | None = None) -> float:
    per_sample = profile.per_sample_s[bits] + sum(s.forward_s for s in profile.segments if s.name in ckpt)
    return k * profile.fixed_s[bits] + (profile.batch_size if samples is None else samples) * per_sample


def accumulation_time(profile: Profile, plan: Plan, samples: int, k: int, act: float, headroom: float) -> float:
    """The model's time, uncorrected, for ``samples`` of the batch in ``k`` micro-batches of ``plan`` of
    ``act`` activation bytes each (forward, backward and trims; NOTE [ The cost model ], 2. and 3.)."""
    ckpt = frozenset(plan.checkpointed)
    return _step_time(profile, plan.bits, ckpt, k, samples) + _trim_time(profile, act, k, headroom)


def keeps_freed(profile: Profile, act: float, k: int, headroom: float) -> bool:
    """Whether a plan of ``k`` micro-batches of ``act`` activation bytes runs without trims, holding what
    one micro-batch freed beside the next (NOTE [ The cost model ], 3.)."""
    return k > 1 and (1 + profile.freed_kept) * act <= headroom


def _footprint(profile: Profile, act: float, k: int, headroom: float) -> float:
    """The accumulation phase's share of the peak: one micro-batch's activations, and the freed memory
    of the one before that the allocator keeps where the plan does not trim."""
    return (1 + profile.freed_kept) * act if keeps_freed(profile, act, k, headroom) else act


def _trim_time(profile: Profile, act: float, k: int, headroom: float) -> float:
    """What a plan's trims cost: none where a micro-batch's activations fit beside what the allocator
    keeps of the one before (NOTE [ The cost model ], 3.)."""
    if k <= 1 or keeps_freed(profile, act, k, headroom):
        return 0.0
    return (2 * k - 1) * profile.refault_s_per_byte * act


def _micro_batching(profile: Profile, bits: Bits, ckpt: frozenset[str], headroom: float,
                    alpha: float) -> tuple[float, int, int, float] | None:
    """The fastest micro-batching of ``(bits, ckpt)`` within ``headroom``: (time, micro-batch size,
    count, activation bytes), or None if one sample does not fit. The largest micro-batch that fits is
    weighed against the largest that never trims."""
    B = profile.batch_size
    per = _activation_per_sample(profile, bits, ckpt) * alpha
    fixed = profile.work_fixed * alpha
    if max(fixed + per, profile.optimizer_transient) > headroom:
        return None
    # one sample fits, so one sample is a candidate, whatever the float rounding of the division says
    caps = {max(1, min(B, int((headroom - fixed) // per))) if per > 0 else B}
    kept_room = headroom / (1 + profile.freed_kept)  # where the previous micro-batch's kept memory fits too
    if per > 0 and kept_room - fixed >= per:
        caps.add(max(1, min(B, int((kept_room - fixed) // per))))
    best: tuple[float, int, int, float] | None = None
    for cap in sorted(caps, reverse=True):
        k = math.ceil(B / cap)
        m = math.ceil(B / k)  # balanced micro-batches: same count, smaller largest slice
        act = fixed + per * m
        t = _step_time(profile, bits, ckpt, k) + _trim_time(profile, act, k, headroom)
        if best is None or t < best[0]:
            best = (t, m, k, act)
    return best


def _checkpoint_orders(profile: Profile, bits: Bits, allow: bool) -> list[frozenset[str]]:
    """Greedy prefixes by bytes freed per second of recompute (Sage's cost-per-bit criterion)."""
    sets = [frozenset()]
    if not allow or not profile.segments:
        return sets
    def gain(s: SegmentProfile) -> float:
        return (s.saved[bits] - s.input_bytes) / max(s.forward_s, 1e-9)
    order = sorted((s for s in profile.segments if s.saved[bits] > s.input_bytes), key=gain, reverse=True)
    chosen: list[str] = []
    for s in order:
        chosen.append(s.name)
        sets.append(frozenset(chosen))
    return sets


def plan_step(profile: Profile, *, budget_bytes: int, persistent_bytes: int, config: PlannerConfig,
              alpha: float = 1.0, time_scale: Mapping[Lever, float] | None = None) -> Plan:
    """The fastest plan whose predicted peak fits ``budget_bytes``; ``time_scale`` corrects each
    lever's predicted time (NOTE [ The cost model ], 4.).

    Raises:
        BudgetTooSmallError: not even one sample per micro-batch with every segment checkpointed
            at the fewest bits fits; the error names the smallest budget that would (a budget of
            exactly ``required_bytes`` plans, with the same profile and ``persistent_bytes``).
        InvalidArgumentError: a profile of a batch without samples.
        UnsupportedError: the profile has no measurement at any of ``config.bits``.
    """
    B = profile.batch_size
    if B < 1:
        raise InvalidArgumentError(f"the profile's batch_size is {B}: there is nothing to plan for a batch without "
                                   "samples; plan (and probe) a batch with at least one sample")
    headroom = _headroom(budget_bytes, persistent_bytes, config)
    candidates: list[tuple[float, Bits, frozenset[str], int, int, float]] = []
    leanest = math.inf
    for bits in (b for b in profile.bits_options if b in config.bits):
        for ckpt in _checkpoint_orders(profile, bits, config.checkpoint):
            leanest = min(leanest, max((profile.work_fixed + _activation_per_sample(profile, bits, ckpt)) * alpha,
                                       profile.optimizer_transient))
            found = _micro_batching(profile, bits, ckpt, headroom, alpha)
            if found is not None:
                t, m, k, act = found
                candidates.append((t * (time_scale or {}).get(lever(bits, ckpt), 1.0), bits, ckpt, m, k, act))
    if not candidates and leanest == math.inf:
        measured = ", ".join("exact" if b is None else f"{b}-bit" for b in profile.bits_options)
        raise UnsupportedError(
            f"PlannerConfig.bits allows {config.bits!r}, but the profile has measurements only for {measured} "
            "(compressed plans are probed on the first step, and only where the headroom holds "
            "PlannerConfig.compression_reserve besides the probe); allow None in bits, lower compression_reserve, "
            "or start with a larger budget")
    if not candidates:
        required = _smallest_budget(leanest, persistent_bytes, config)
        raise BudgetTooSmallError(
            budget_bytes, required,
            f"the process already holds {format_bytes(persistent_bytes)} (model, optimizer state, batch, runtime)",
        )
    fastest = min(c[0] for c in candidates)
    near = [c for c in candidates if c[0] <= fastest * (1 + config.prefer_exact_within)]
    # within the margin, the most bits, then the fewest recomputed segments: measured time corrections
    # (NOTE [ The cost model ], 4.) are noisy, and a gap that small is no reason to lose precision or recompute
    t, bits, ckpt, m, k, act = max(near, key=lambda c: (_bits_rank(c[1]), -len(c[2]), -c[0]))
    act = _footprint(profile, act, k, headroom)
    order = [s.name for s in profile.segments if s.name in ckpt]
    return Plan(
        budget_bytes=int(budget_bytes), persistent_bytes=int(persistent_bytes), batch_size=B, micro_batch_size=m,
        num_micro_batches=k, checkpointed=tuple(order), bits=bits,
        predicted_peak_bytes=int(persistent_bytes + max(act, profile.optimizer_transient)), predicted_step_s=t,
        alpha=alpha, segments=profile.segments, predicted_activation_bytes=int(act),
    )
