"""The bit policy a ``compress`` context consults once per quantized record: ``FixedBits`` for an integer
``bits``, ``AutoBits`` for ``bits="auto"``.

``AutoBits`` measures each saved tensor's importance on an *adaptation step* (the first step, every
``adapt_interval`` steps, and the step after the saved tensors' shapes change; ``tracing.py``), then
solves the bit allocation (``allocation.py``) that the following steps use (see ``NOTE [ Slots ]`` in
``report.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fractions
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..config import DEFAULT_AVG_BITS, CompressionConfig
from ..errors import InvalidArgumentError, UnsupportedError
from ..layout import widest_bits_within
from ..params import ParameterRegistry
from .allocation import AllocationError, Choice, Solution, budget_for_avg_bits, choices_for, solve, solve_for_variance
from .report import AllocationReport, SlotAllocation, SlotEstimate, SlotKey
from .state import (
    auto_config,
    auto_state_dict,
    fixed_state_dict,
    load_fixed_state,
    model_fingerprint,
    parse_auto_state,
    refuse,
)
from .tracing import (
    NONLINEAR_SAVER_MIN_BITS,
    Observation,
    SaveTracer,
    floor_bits,
    lands_in_a_parameter,
    nonlinear_saver,
    observe,
)
from .variance import GradProbe, check_variance

__all__ = ["BIAS_FLOOR_BITS", "UNCALIBRATED_BITS", "Assignment", "AutoBits", "BitPolicy", "FixedBits",
           "make_bit_policy"]

UNCALIBRATED_BITS = 4
"""With ``error_share``, every quantized tensor's bits until the first calibration; see
``NOTE [ A variance target ]``."""

BIAS_FLOOR_BITS = 4
"""With ``error_share``, the fewest bits of a tensor whose saving op's backward is nonlinear in it; see
``NOTE [ A variance target ]``."""

UNIFORM_MARGIN = 0.03
"""Under an ``avg_bits`` target of a supported width, the least share of the safe allocation's estimated
variance an allocation must save to be taken instead of it; see ``NOTE [ Uniform unless clearly better ]``."""

TRADE_FACTOR = 2.0
"""And the least ratio of the variance it saves on the tensors it raises above the safe allocation to the
variance it adds on those it lowers; see ``NOTE [ Uniform unless clearly better ]``."""


class Assignment(NamedTuple):
    """What a bit policy decides for one record."""

    bits: int | None
    """Bits to quantize it to (the treatment's floor applied); ``None`` keeps it exact."""
    importance: float
    """Where the page pool orders it (lower is demoted or spilled first); see
    ``NOTE [ Importance of a record in the pool ]``."""


class BitPolicy(Protocol):
    """The bits of every quantized record of a ``compress`` context, and their persistence."""

    def enter(self, step: int) -> None:
        """The forward of ``step`` starts (this thread's)."""

    def exit(self) -> None:
        """This thread's forward ends."""

    def assign(self, step: int, index: int, source: torch.Tensor | None, flat: torch.Tensor, min_bits: int,
               saved_again: bool = False, stored_as: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> Assignment:
        """The record at forward position ``index`` of ``step``: ``flat`` its values, ``source`` the
        tensor autograd saved, ``min_bits`` the floor its treatment sets (``saved/decide.py``). With
        ``saved_again`` the record exists already and another op saves it once more (only ``index``
        and ``source`` are read, and the return value means nothing). ``stored_as(flat)`` is what the
        record stores where that is not the values (a GELU input's ``f'(x)``, NOTE [ Derivative
        encoding under bits="auto" ] in saved/decide.py): what an estimate observes."""
        ...

    def report(self) -> AllocationReport | None:
        """The allocation in force (``None`` with fixed bits)."""
        ...

    def wants_calibration(self, *, pending: bool = False) -> bool:
        """True when the context should calibrate this step on its loss (``NOTE [ A variance target ]``);
        with ``pending``, also when it may once this step's first record is assigned."""
        ...

    def state_dict(self, step: int) -> dict[str, Any]:
        """Plain Python values from which ``load_state_dict`` restores the same decisions."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Validate ``state`` completely, then apply it; returns its step. Nothing changes on error."""
        ...


def make_bit_policy(config: CompressionConfig, model: nn.Module | None = None) -> FixedBits | AutoBits:
    """``AutoBits`` for ``bits="auto"``, else ``FixedBits``."""
    return AutoBits(config, model) if config.auto else FixedBits(config)


# NOTE [ Importance of a record in the pool ]
# With ``bits="auto"`` a quantized record's importance is the gradient variance its slot adds at its
# allocated bits: demoting any record scales its variance by the same factor, so the records adding
# least variance go first. Otherwise (fixed bits, before the first allocation, or a slot the allocation
# does not know) the pool orders records by forward position, ``float(index)``: the earliest saved is
# the least important. Backward needs it last, so a record demoted or spilled first is also the one
# with the most time to be paged back in. (Records that are not quantized, bool masks and constants,
# are ordered by forward position too; ``saved/hooks.py`` does not consult the policy for them.)
class FixedBits:
    """The bit policy of an integer ``bits`` (or ``None``): every quantized record gets ``config.bits``."""

    def __init__(self, config: CompressionConfig) -> None:
        if config.auto:
            raise InvalidArgumentError("FixedBits needs an integer CompressionConfig.bits (or None); use AutoBits "
                                       "for bits='auto'")
        self.config = config
        self._bits = config.bits if isinstance(config.bits, int) else None

    def enter(self, step: int) -> None:
        """Nothing to do: fixed bits trace nothing."""

    def exit(self) -> None:
        """Nothing to do: fixed bits trace nothing."""

    def assign(self, step: int, index: int, source: torch.Tensor | None, flat: torch.Tensor, min_bits: int,
               saved_again: bool = False, stored_as: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> Assignment:
        """``config.bits`` raised to ``min_bits``, importance ``float(index)``."""
        bits = self._bits
        return Assignment(None if bits is None else max(bits, min_bits), float(index))

    def report(self) -> None:
        """Fixed bits allocate nothing."""
        return None

    def wants_calibration(self, *, pending: bool = False) -> bool:
        """Fixed bits calibrate nothing."""
        return False

    def state_dict(self, step: int) -> dict[str, Any]:
        """The step counter (the rounding seeds follow it)."""
        return fixed_state_dict(self.config, step)

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Validate a fixed-bits state; returns its step."""
        return load_fixed_state(self.config, state)


# NOTE [ A variance target ]
# ``error_share`` turns the allocation around: instead of the least variance under a byte budget, the
# fewest bytes whose estimated quantization variance is at most ``error_share`` times the gradient's
# squared norm ``||g||^2`` (``solve_for_variance``). For a gradient ``g`` and an added zero-mean error
# ``e``, ``cos(g, g + e) ~= 1 - ||e||^2 / (2 ||g||^2)``, so the bound holds the cosine to the exact
# gradient near ``1 - error_share / 2``; where the minibatch gradient's own noise dominates ``||g||^2``,
# the bound is also a small share of that noise (the quantity ``variance_warning`` watches).
# A bound in absolute terms needs the estimate in absolute terms, which only calibration gives: the
# analytic estimate counts noise where it first lands and is orders of magnitude low on transformers
# (``NOTE [ Calibration ]``; docs/zoo.md). So until the first calibration every quantized tensor gets
# ``UNCALIBRATED_BITS``; ``calibrate`` measures the class corrections and ``||g||^2`` (its base pass) on
# the step after an adaptation step, and the allocation follows from them. The ``compress`` context
# calibrates by itself on that step when the loss is computed under it (``wants_calibration``, and
# ``LossCatcher`` in ``calibration.py``); otherwise the user calls ``ctx.calibrate(loss)``.
# A tensor saved by traced ops whose outputs got no gradient gets the median sensitivity here, not zero:
# an output modified in place afterwards (HuBERT writes its masked time steps into the projection's
# output) can hide the gradient that reaches the tensor, and a zero cannot be corrected by calibration.
# The bound counts variance, not the bias that rounding makes under a backward that is nonlinear in what
# it reads (NOTE [ Fewest bits ]): under ``error_share`` no tensor goes below 2 bits, and one such a
# backward reads not below ``BIAS_FLOOR_BITS`` (without it the character GPT-2 of the parity benchmark
# trained as at fixed 2 bits; docs/auto.md).
class AutoBits:
    """The bit policy of ``compress(bits="auto")``; see the module docstring and the NOTEs it names.

    Thread-safe: two threads may run their forwards (and backwards) under one context; see
    ``NOTE [ One tracer per thread ]`` in ``tracing.py``."""

    def __init__(self, config: CompressionConfig, model: nn.Module | None = None) -> None:
        if not config.auto:
            raise InvalidArgumentError(f"AutoBits needs CompressionConfig(bits='auto'), got bits={config.bits!r}")
        self.config = config
        self._params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self._fingerprint = model_fingerprint(model) if model is not None else None
        self._gradient_sq: float | None = None
        self._calibrated_for: int | None = None  # the estimate (its step) the last calibration measured
        if config.error_share is not None:
            self.avg_bits: float | None = None
            self._fallback = UNCALIBRATED_BITS
        elif config.packed_bytes is not None:
            self.avg_bits = None
            self._fallback = 1
        else:
            self.avg_bits = float(config.avg_bits) if config.avg_bits is not None else DEFAULT_AVG_BITS
            self._fallback = widest_bits_within(self.avg_bits)
        self._lock = threading.RLock()
        self._tracer = SaveTracer(ParameterRegistry(model))
        self._step = -1
        self._adapt_step = -1
        self._next_adapt = 0
        self._adapting = False
        self._reestimate = False
        self._observed: dict[SlotKey, Observation] = {}
        self._by_index: dict[int, Observation] = {}
        self._pending = False
        self._bits: dict[SlotKey, int | None] = {}
        # the allocation by (position, dtype), and the step's numel ratio to it: NOTE [ Another batch size ]
        self._positions: tuple[dict[SlotKey, int | None], dict[tuple[int, str], tuple[int, int | None]]] | None = None
        self._step_ratio: fractions.Fraction | None = None
        self._report: AllocationReport | None = None
        self._probe: GradProbe | None = None
        self._grad_variance: float | None = None
        self._slot_variance: tuple[AllocationReport, dict[SlotKey, float]] | None = None
        self._calibration: dict[str, float] = {}

    @property
    def params(self) -> list[nn.Parameter]:
        """The model's trainable parameters (empty without ``model``)."""
        return self._params

    # -- tracing the saving ops (adaptation steps) ---------------------------------------------------
    def enter(self, step: int) -> None:
        """The forward of ``step`` starts: trace it when it may adapt (see ``NOTE [ Importance estimate ]``)."""
        with self._lock:
            self._tracer.stop()
            if step != self._step and self._pending and self._complete():
                self._finalize()  # what the step's first record would do; its backward is over
            may_adapt = (self._adapting if step == self._step
                         else self._pending or self._reestimate or step >= self._next_adapt)
            if may_adapt:
                self._tracer.start()

    def exit(self) -> None:
        """This thread's forward ends: stop tracing it."""
        self._tracer.stop()

    @contextlib.contextmanager
    def ignoring_gradients(self) -> Iterator[None]:
        """Backward passes run inside do not count in the estimate (``compress.calibrate``'s extra passes)."""
        with self._tracer.ignoring_gradients():
            yield

    # -- the per-record decision -------------------------------------------------------------------
    def assign(self, step: int, index: int, source: torch.Tensor | None, flat: torch.Tensor, min_bits: int,
               saved_again: bool = False, stored_as: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> Assignment:
        """Bits and pool importance of the record at forward position ``index`` of ``step``; see
        ``BitPolicy.assign``."""
        with self._lock:
            if saved_again:
                self._note_saved_again(step, index, source)
                return Assignment(None, float(index))
            if step != self._step:
                self._new_step(step)
            key = SlotKey.of(index, flat)
            if self._adapting:
                self._observe(key, source, flat if stored_as is None else stored_as(flat), min_bits)
            bits = self._bits_for(key)
            importance = self._importance_of(key)
        return Assignment(None if bits is None else max(bits, min_bits),
                          float(index) if importance is None else importance)

    def _note_saved_again(self, step: int, index: int, source: torch.Tensor | None) -> None:
        if self._adapting and step == self._step and self._tracer.active and source is not None:
            obs = self._by_index.get(index)
            if obs is not None:
                self._tracer.note(obs, source)

    def _bits_for(self, key: SlotKey) -> int | None:
        if key in self._bits:
            return self._bits[key]
        if self._bits and not self._adapting:
            scaled = self._scaled_bits(key)
            if scaled is not None:
                return scaled[0]
            self._reestimate = True  # shapes changed: see NOTE [ Slots ]
        return self._fallback

    # NOTE [ Another batch size ]
    # A batch of another size (a ragged last batch, or the micro-batches a memory budget plans) saves the
    # same tensors at the same forward positions, each with its numel scaled by one ratio. Under an
    # ``avg_bits`` target the allocation carries over: each position keeps its bits, and the bytes scale
    # with the values, so the average stays the target. So where a step's unknown slot is at a known
    # position with the same dtype, and its numel over the allocation's is the ratio every other such slot
    # of the step has (the first one sets it), it gets that position's bits; any other change (another
    # sequence length scales attention scores by the ratio squared) is new shapes, and the next step
    # re-estimates. Under ``packed_bytes`` (an absolute byte count) or ``error_share`` (a bound the
    # calibration measured at the old size) the allocation is not carried over.
    def _scaled_bits(self, key: SlotKey) -> tuple[int | None] | None:
        """The bits of ``key``'s position in the allocation, where ``key`` is that slot at the step's one
        numel ratio (NOTE [ Another batch size ]); ``None`` otherwise."""
        if self.avg_bits is None:
            return None
        if self._positions is None or self._positions[0] is not self._bits:
            self._positions = (self._bits, {(k.index, k.dtype): (k.numel, b) for k, b in self._bits.items()})
        known = self._positions[1].get((key.index, key.dtype))
        if known is None:
            return None
        ratio = fractions.Fraction(key.numel, known[0])
        if self._step_ratio is None:
            self._step_ratio = ratio
        return (known[1],) if ratio == self._step_ratio else None

    def _importance_of(self, key: SlotKey) -> float | None:
        """The estimated gradient variance the slot adds at its allocated bits (``None`` before the first
        allocation, or for a slot it does not know); see ``NOTE [ Importance of a record in the pool ]``."""
        report = self._report
        if report is None:
            return None
        if self._slot_variance is None or self._slot_variance[0] is not report:
            self._slot_variance = (report, {a.key: a.variance for a in report.slots})
        return self._slot_variance[1].get(key)

    def _new_step(self, step: int) -> None:
        self._step = step
        self._step_ratio = None
        if self._pending:
            self._finalize()
        if self._probe is not None:
            variance = self._probe.next_step()
            if variance is not None:
                self._probe = None
                self._grad_variance = variance
                if self._report is not None:
                    self._report = check_variance(self._report, variance, self.config.variance_warning)
        self._adapting = self._reestimate or step >= self._next_adapt
        if self._adapting:
            self._adapt_step = step
            self._reestimate = False
            self._observed, self._by_index = {}, {}
            self._pending = True
            if self._params and self._probe is None and self.config.variance_warning is not None:
                self._probe = GradProbe(self._params)

    def _observe(self, key: SlotKey, source: torch.Tensor | None, flat: torch.Tensor, min_bits: int) -> None:
        obs = observe(key, source, flat, min_bits, self.config.group_size)
        self._observed[key] = obs
        self._by_index[key.index] = obs
        if source is not None:
            self._tracer.note(obs, source)

    # -- allocation --------------------------------------------------------------------------------
    def _complete(self) -> bool:
        """True when the adaptation step's backward has delivered every gradient it will deliver."""
        hooked = [o for o in self._observed.values() if o.hooked]
        return bool(hooked) and all(o.grad_sq is not None for o in hooked)

    def _finalize(self) -> None:
        self._pending = False
        observed = sorted(self._observed.values(), key=lambda o: o.key)
        self._observed, self._by_index = {}, {}
        if not observed:  # nothing to allocate this time (e.g. a pass that quantized nothing)
            self._next_adapt = self._adapt_step + self.config.adapt_interval
            return
        if not any(o.grad_sq is not None for o in observed):
            self._reestimate = True  # no backward ran after the adaptation step: try again
            return
        known = sorted(o.sensitivity for o in observed if o.grad_sq is not None)
        default = known[len(known) // 2]
        sens = []
        for o in observed:
            if o.grad_sq is not None:
                sens.append(o.sensitivity)
            elif o.traced and not o.rewritten and self.config.error_share is None:
                sens.append(0.0)  # saved by traced ops whose outputs got no gradient: its noise should not reach one
            else:  # NOTE [ A variance target ]: a bound does not take an unmeasured zero on trust
                sens.append(default)
        slots = [SlotEstimate(o.key, o.shape, o.itemsize, "+".join(o.ops), o.producer, o.grad_sq, o.noise, s,
                              self._floor(o)) for o, s in zip(observed, sens, strict=True)]
        next_adapt = self._adapt_step + self.config.adapt_interval
        self._bits, self._report = self._solve(slots, self._adapt_step, next_adapt, self._grad_variance)
        self._next_adapt = next_adapt

    def _floor(self, o: Observation) -> int:
        """The fewest bits of an observed record: NOTE [ Fewest bits ] in tracing.py, and the uniform width
        of an ``avg_bits`` target until a calibration (NOTE [ Below the width asked for ])."""
        floor = floor_bits(o.ops, o.min_bits, o.noise, o.activation_product)
        unmeasured = o.grad_sq is None and (o.rewritten or not o.traced)  # it is priced at the median
        if self.avg_bits is not None and not self._calibration and (
                unmeasured or not lands_in_a_parameter(o.ops, o.activation_product)):
            floor = max(floor, self._fallback)
        return floor

    def _budget(self, slots: list[SlotEstimate]) -> int:
        """The byte budget: ``packed_bytes``, or ``avg_bits`` per value where each slot counts at its floor
        where that is more, as fixed bits raise a record to its treatment's floor: an integer
        ``avg_bits`` is then exactly the bytes fixed bits of that width store."""
        if self.config.packed_bytes is not None:
            return self.config.packed_bytes
        assert self.avg_bits is not None
        avg, group = self.avg_bits, self.config.group_size
        return sum(budget_for_avg_bits([e.key.numel], max(avg, e.min_bits), group) for e in slots)

    def _solve(self, slots: list[SlotEstimate], estimated_at: int, next_adapt: int,
               grad_variance: float | None) -> tuple[dict[SlotKey, int | None], AllocationReport]:
        """The allocation for ``slots`` under the calibration in force; pure."""
        group = self.config.group_size
        unmeasured = self._unmeasured_calibration()
        factors = [self._calibration.get(e.slot_class, unmeasured) for e in slots]

        def least(e: SlotEstimate) -> int:  # NOTE [ A variance target ]
            if self.config.error_share is None:
                return e.min_bits
            return max(e.min_bits, BIAS_FLOOR_BITS if nonlinear_saver(e.op) else NONLINEAR_SAVER_MIN_BITS)

        def choices(floored: bool) -> list[tuple[Choice, ...]]:
            return [choices_for(e.key.numel, e.itemsize, group, e.noise, e.sensitivity * f,
                                min_bits=least(e) if floored else 1)
                    for e, f in zip(slots, factors, strict=True)]

        items = choices(floored=True)
        if self.config.error_share is not None:
            solution = self._solve_for_variance(items)
            budget = solution.nbytes
        else:
            budget = self._budget(slots)
            if sum(c[0].nbytes for c in items) > budget:  # a budget below the floors: NOTE [ Fewest bits ]
                items = choices(floored=False)
            solution = self._unless_clearly_better(solve(items, budget), items, budget)
        allocated = []
        for e, f, c, pick in zip(slots, factors, items, solution.picks, strict=True):
            ch = c[pick]
            estimate = {field.name: getattr(e, field.name) for field in dataclasses.fields(SlotEstimate)}
            allocated.append(SlotAllocation(**estimate, calibration=f, bits=ch.bits, nbytes=ch.nbytes,
                                            variance=ch.variance))
        report = AllocationReport(estimated_at, next_adapt, budget, solution.nbytes, tuple(allocated),
                                  solution.variance, grad_variance, self._gradient_sq)
        return {a.key: a.bits for a in allocated}, report

    # NOTE [ Uniform unless clearly better ]
    # Under ``avg_bits=b`` with ``b`` a supported width, fixed ``b`` bits (each tensor at ``b`` or its floor)
    # is itself an allocation within the budget, and the one a user would otherwise run. The estimate that
    # ranks the others is uncertain per tensor (its calibration factors differ several-fold between
    # classes), so an allocation whose estimated variance is within a few per cent of the uniform one's is
    # a trade the estimate cannot tell from a loss: one that moved a linear input to 1 bit to give an
    # attention operand 4 bits, for a small estimated gain, made a vision transformer's gradient clearly
    # worse than uniform bits (docs/auto.md, where the margin's value was measured over the zoo). So the
    # solver's allocation is taken only where it promises at least ``UNIFORM_MARGIN`` less variance than a
    # safe one: no tensor whose noise reaches a gradient below the width, the bytes of tensors whose noise
    # reaches none (sensitivity 0, a trade with no risk) spent on the others; otherwise the safe one is.
    # The total alone does not bound the risk: an allocation is a trade, variance added on the tensors it
    # lowers for variance saved on those it raises, and each side is a different tensor's estimate, either
    # of which can be off by a factor: a trade past the margin in total that saved little more than it
    # added measured clearly worse than uniform bits on the same vision transformer (docs/auto.md). So the
    # saving must also be at least ``TRADE_FACTOR`` times the addition: a trade that survives either side's
    # estimate being off by up to its square root.
    def _unless_clearly_better(self, solution: Solution, items: list[tuple[Choice, ...]], budget: int) -> Solution:
        """``solution``, or the safe allocation where ``solution`` does not clearly beat it: no tensor whose
        noise reaches a gradient below the uniform width, the bytes of those whose noise reaches none (every
        choice of variance 0) spent by the solver on the rest."""
        if self.avg_bits is None or self.avg_bits != self._fallback:
            return solution
        kept: list[list[int]] = []
        for c in items:
            width = max(self._fallback, c[0].bits if c[0].bits is not None else self._fallback)
            free = all(ch.variance == 0 for ch in c)
            kept.append([i for i, ch in enumerate(c) if free or ch.bits is None or ch.bits >= width])
        try:
            safe = solve([tuple(c[i] for i in k) for c, k in zip(items, kept, strict=True)], budget)
        except AllocationError:
            return solution
        picks = tuple(k[p] for k, p in zip(kept, safe.picks, strict=True))
        moved = [c[s].variance - c[p].variance for c, s, p in zip(items, solution.picks, picks, strict=True)]
        added, saved = math.fsum(d for d in moved if d > 0), -math.fsum(d for d in moved if d < 0)
        if solution.variance < (1 - UNIFORM_MARGIN) * safe.variance and saved >= TRADE_FACTOR * added:
            return solution
        return Solution(picks, safe.nbytes, safe.variance, budget, safe.skipped_gain)

    def _solve_for_variance(self, items: list[tuple[Choice, ...]]) -> Solution:
        """``error_share``'s allocation; every tensor at ``UNCALIBRATED_BITS`` (or its floor) before the
        first calibration. See ``NOTE [ A variance target ]``."""
        if self._gradient_sq is None:
            picks = tuple(next(k for k, c in enumerate(cs) if c.bits is not None and c.bits >= self._fallback)
                          for cs in items)
            chosen = [cs[k] for cs, k in zip(items, picks, strict=True)]
            nbytes = sum(c.nbytes for c in chosen)
            return Solution(picks, nbytes, math.fsum(c.variance for c in chosen), nbytes, 0.0)
        assert self.config.error_share is not None
        return solve_for_variance(items, self.config.error_share * self._gradient_sq)

    # -- calibration (see NOTE [ Calibration ] in calibration.py) -----------------------------------
    def _unmeasured_calibration(self) -> float:
        """The correction of a slot class never measured: the geometric median of the measured ones,
        1.0 before any calibration."""
        if not self._calibration:
            return 1.0
        logs = sorted(math.log(f) for f in self._calibration.values())
        mid = len(logs) // 2
        return math.exp(logs[mid] if len(logs) % 2 else (logs[mid - 1] + logs[mid]) / 2)

    def calibration_targets(self) -> dict[str, list[tuple[SlotKey, float]]]:
        """Slots of the allocation in force by class: ``(key, analytic sensitivity)``."""
        report = self.report()
        if report is None:
            raise UnsupportedError("calibrate() needs an allocation first: call it on a step after the first "
                                   "step's backward (bits='auto' estimates importance on that step)")
        targets: dict[str, list[tuple[SlotKey, float]]] = {}
        for a in report.slots:
            targets.setdefault(a.slot_class, []).append((a.key, a.sensitivity))
        return targets

    @property
    def calibration(self) -> dict[str, float]:
        """The class corrections in force (a copy)."""
        with self._lock:
            return dict(self._calibration)

    def class_correction(self, slot_class: str) -> float:
        """The correction in force for ``slot_class`` (measured, or the unmeasured classes' median)."""
        with self._lock:
            return self._calibration.get(slot_class, self._unmeasured_calibration())

    def variance_bound(self) -> float | None:
        """``error_share``'s bound on the estimated variance (``None`` before a calibration, or with a byte
        budget)."""
        share = self.config.error_share
        return None if share is None or self._gradient_sq is None else share * self._gradient_sq

    def scale_calibration(self, factor: float) -> None:
        """Multiply every class correction by ``factor`` and re-solve (``NOTE [ Verifying a variance target ]``
        in ``calibration.py``)."""
        if not (math.isfinite(factor) and factor > 0):
            raise InvalidArgumentError(f"factor must be a positive finite float, got {factor!r}")
        with self._lock:
            classes = {a.slot_class for a in self._report.slots} if self._report is not None else set()
            scaled = {cls: self.class_correction(cls) * factor for cls in classes | set(self._calibration)}
        self.set_calibration(scaled)

    def wants_calibration(self, *, pending: bool = False) -> bool:
        """True when ``error_share``'s allocation in force follows from an estimate no calibration has
        measured yet; with ``pending``, also when an estimate awaits its allocation (it comes with this
        step's first record). See ``NOTE [ A variance target ]``."""
        with self._lock:
            if self.config.error_share is None:
                return False
            report = self._report
            return ((pending and self._pending)
                    or (report is not None and self._calibrated_for != report.estimated_at_step))

    def set_calibration(self, factors: Mapping[str, float], gradient_sq: float | None = None) -> None:
        """Adopt measured class corrections (and the gradient's squared norm ``gradient_sq`` they were
        measured on) and re-solve the allocation in force with them."""
        for cls, f in factors.items():
            if not (isinstance(f, float) and math.isfinite(f) and f > 0):
                raise InvalidArgumentError(f"calibration of {cls!r} must be a positive finite float, got {f!r}")
        if gradient_sq is not None and not (isinstance(gradient_sq, float) and math.isfinite(gradient_sq)
                                            and gradient_sq >= 0):
            raise InvalidArgumentError(f"gradient_sq must be a non-negative finite float, got {gradient_sq!r}")
        with self._lock:
            self._calibration.update(factors)
            if gradient_sq is not None and gradient_sq > 0:
                self._gradient_sq = gradient_sq
            report = self._report
            if report is not None:
                self._calibrated_for = report.estimated_at_step
                self._bits, self._report = self._solve(list(report.slots), report.estimated_at_step,
                                                       report.next_adapt_step, self._grad_variance)

    # -- visibility and persistence ----------------------------------------------------------------
    def report(self) -> AllocationReport | None:
        """The allocation in force (``None`` before the first adaptation step's backward)."""
        with self._lock:
            if self._pending and self._complete():
                self._finalize()
            return self._report

    def state_dict(self, step: int) -> dict[str, Any]:
        """The allocation in force and the estimates it follows from; see ``state.py``."""
        with self._lock:
            if self._pending:
                if not self._complete():
                    raise UnsupportedError(
                        "state_dict() was called between the forward and the backward of an adaptation step; "
                        "call it after loss.backward() so the saved state holds that step's estimate"
                    )
                self._finalize()
            return auto_state_dict(step=step, config=self._config_dict(), fingerprint=self._fingerprint,
                                   next_adapt=self._next_adapt, reestimate=self._reestimate, report=self._report,
                                   grad_variance=self._grad_variance, calibration=self._calibration,
                                   gradient_sq=self._gradient_sq, calibrated_for=self._calibrated_for)

    def _config_dict(self) -> dict[str, Any]:
        return auto_config(self.config, self.avg_bits)

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Validate ``state`` completely (``state.parse_auto_state``), check that its bits follow from its
        estimates, then apply it; returns its step. Nothing changes on error."""
        parsed = parse_auto_state(state, config=self._config_dict(), fingerprint=self._fingerprint)
        with self._lock:
            keys = {e.key for e, _ in parsed.slots}
            if self._bits and parsed.slots and set(self._bits) != keys:
                raise refuse("its slots (saved tensors) differ from the ones this context has seen; "
                             "it belongs to another model")
            bits: dict[SlotKey, int | None] = {}
            report = None
            current = self._calibration, self._gradient_sq
            self._calibration, self._gradient_sq = parsed.calibration, parsed.gradient_sq
            try:
                if parsed.slots:
                    assert parsed.estimated_at is not None
                    try:
                        bits, report = self._solve([e for e, _ in parsed.slots], parsed.estimated_at,
                                                   parsed.next_adapt, parsed.grad_variance)
                    except AllocationError:
                        raise refuse("its slots do not fit its budget (corrupted, or saved by another daftrain "
                                     "version)") from None
                    if bits != {e.key: b for e, b in parsed.slots}:
                        raise refuse("its bits do not follow from its importance estimates (corrupted, or "
                                     "saved by another daftrain version)")
            except BaseException:
                self._calibration, self._gradient_sq = current
                raise
            self._calibrated_for = parsed.calibrated_for
            self._bits, self._report, self._grad_variance = bits, report, parsed.grad_variance
            self._next_adapt, self._reestimate = parsed.next_adapt, parsed.reestimate
            self._step = parsed.step
            self._pending, self._observed, self._by_index, self._adapting = False, {}, {}, False
            return parsed.step
