"""Measuring how much gradient variance each class of saved tensors really adds (``compress.calibrate``)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ..callbacks import EagerMode
from ..errors import InvalidArgumentError, UnsupportedError
from ..kernels import ops as kernel_ops
from ..layout import record_seed
from .policy import AutoBits, BitPolicy
from .report import SlotAllocation
from .variance import squared_norm

__all__ = ["CalibrationPass", "LossCatcher", "StoredQuantity", "calibrate", "graph_leaves", "squared_distance"]

# NOTE [ Calibration ]
# The analytic importance estimate (``NOTE [ Importance estimate ]`` in ``tracing.py``) counts a
# tensor's noise where it first lands. That is right for a contraction whose other operand is a
# weight (the noise lands in that weight's gradient), but noise that lands in an *activation*
# gradient (a softmax's or GELU's input, the other operand of ``q @ k^T``) then flows through every
# layer below, and the estimate misses that by orders of magnitude. Measured against the variance
# each class of tensors really adds, the estimate is a few times too high for the inputs of weight
# contractions and up to orders of magnitude too low for the rest, and the error grows as training
# goes on (``tests/auto/test_calibration.py`` shows it on a small MLP).
# GACT measures every tensor with three extra forward+backward passes; daftrain measures each *class*
# of slots (same saving op, producer and size: one per layer kind, shared across depth) with one
# extra *backward* pass, on a forward the user has already run:
#   1. ``calibrate(loss)`` runs ``torch.autograd.grad(loss, params, retain_graph=True)`` once as it
#      is (the base) and once per class with zero-mean noise added to that class's records on the way
#      out of the unpack hook: the error of rounding the decoded values to 2 bits, stochastically, as
#      the layout does (zeros of zero-exact groups kept), so the noise sits where real rounding puts it
#      (little on values near a level, as GELU outputs crowd their minimum: see ``NOTE [ Measured
#      rounding noise ]`` in allocation.py, whose energy the allocation multiplies by the correction);
#      a fixed seed per record, so two consumers of one record see the same values. Where the values
#      already sit on a grid as coarse (a record stored at 1 or 2 bits, whose 2-bit re-rounding adds
#      almost nothing) the noise is uniform over the group's 2-bit step instead. Only there: values that
#      crowd a level (a trained model's peaked attention probabilities, most of them far below their
#      group's 2-bit step) also re-round with little energy, and uniform noise of the whole step on each
#      of them is orders of magnitude more than rounding puts there, far outside where the backward is
#      linear in the noise: the variance it measures, divided by that noise, overstates the class's
#      correction by orders of magnitude, and the allocation then keeps such tensors exact at every
#      bit-width (docs/auto.md has the measurement). The decodes are otherwise what the step's own
#      backward will see, so the difference from the base is the added noise's effect alone, and its
#      squared norm is the gradient variance that noise adds (one draw; it sums over every trainable
#      parameter, so it concentrates);
#   2. the squared norm of the added noise itself is measured as it is drawn;
#   3. the class's calibration is ``measured / sum_i(s_i * noise_i)``: the ratio of true to analytic
#      variance per unit of noise. The allocation then uses ``s_i * calibration * energy(bits)``:
#      the analytic estimate keeps the depth-to-depth differences within a class, the calibration
#      fixes the scale between classes. A class not measured gets the geometric median.
# Cost: one backward per class plus one, and no extra memory but one set of parameter gradients;
# ``benchmarks/bench_importance_overhead.py`` measures it. The passes leave ``.grad``, the RNG, the
# step counter and the records untouched: the step's own ``loss.backward()`` is what it would have been.
_COARSER_GRID = 0.25
"""Re-rounding a record stored at ``_COARSE_BITS`` or fewer to 2 bits adds less than this share of uniform
noise's energy: its values already sit on a grid as coarse, and the calibration adds uniform noise instead
(``NOTE [ Calibration ]``)."""
_COARSE_BITS = 2
"""Records stored at this many bits or fewer may sit on a grid that 2-bit re-rounding leaves as it is."""
_CALIBRATION_SEED = 0x5EEDCA1B  # calibrate()'s noise draws differ from the records' rounding draws


class StoredQuantity(Protocol):
    """An op-aware encoding that stores another quantity than the values (``Derivative``: ``f'(x)``)."""

    def stored(self, x: torch.Tensor) -> torch.Tensor: ...

    def restored(self, stored: torch.Tensor) -> torch.Tensor: ...


class CalibrationPass:
    """One extra backward pass: the records at ``indices`` (forward positions) get zero-mean noise as they
    are unpacked; ``noise`` collects its squared norm, per record. With ``bits`` (a verification pass,
    ``NOTE [ Verifying a variance target ]``) the records are quantized again at those bits instead."""

    def __init__(self, indices: dict[int, int], group_size: int, base_seed: int, step: int,
                 bits: Mapping[int, int] | None = None) -> None:
        self.indices = indices  # forward position -> numel it must have (a mismatch is left alone)
        self.group_size = group_size
        self.base_seed = base_seed
        self.step = step
        self.bits = bits
        self.noise: dict[int, float] = {}

    def perturb(self, index: int | None, flat: torch.Tensor,
                requantize: Callable[[torch.Tensor, int, int], torch.Tensor],
                quantity: StoredQuantity | None = None, stored_bits: int | None = None) -> torch.Tensor:
        """``flat`` with this pass's noise when it is the record at ``index`` of a measured class;
        ``requantize(flat, bits, seed)`` stores and restores ``flat`` the way its record was (used by a
        verification pass). Where the record stores another ``quantity`` of the values, the noise is
        added to that and measured there (NOTE [ Derivative encoding under bits="auto" ] in
        saved/decide.py). ``stored_bits``: the bits the record is stored at (``None``: exact)."""
        if index is None or self.indices.get(index) != flat.numel() or not flat.is_floating_point():
            return flat
        if self.bits is not None:
            return self._quantize_again(index, flat, requantize, quantity)
        values = flat.detach().float() if quantity is None else quantity.stored(flat)
        n, group = values.numel(), self.group_size
        seed = record_seed(self.base_seed, self.step, index)
        codes, lo, scale = kernel_ops.quantize_pack(values.contiguous().view(-1), 2, group, seed)
        restored = kernel_ops.unpack_dequantize(codes, lo, scale, 2, group, n, torch.float32)
        noise = restored.view_as(values) - values
        if stored_bits is not None and stored_bits <= _COARSE_BITS:  # values that may sit on a grid as coarse
            mn, mx, _ = kernel_ops.group_minmax(values, group).unbind(1)
            step = (mx - mn) / 3  # the 2-bit step of each group
            uniform_energy = float((step.double() ** 2).sum()) * group / 12
            if float(noise.double().pow(2).sum()) < _COARSER_GRID * uniform_energy:
                gen = torch.Generator(device=values.device).manual_seed(seed)
                uniform = torch.rand((step.numel(), group), generator=gen, dtype=torch.float32,
                                     device=values.device) - 0.5
                noise = (uniform * step[:, None]).view(-1)[:n].view_as(values) * (values != 0)
        if not bool(torch.isfinite(noise).all()):
            return flat
        noisy = values + noise
        first = index not in self.noise  # a record two ops saved is drawn the same way for both: count it once
        if quantity is None:
            out = noisy.to(flat.dtype)
            if first:
                self.noise[index] = squared_distance([out], [flat])
            return out
        if first:
            self.noise[index] = squared_distance([noisy], [values])
        return quantity.restored(noisy, flat.dtype)  # restored() overwrites noisy

    def _quantize_again(self, index: int, flat: torch.Tensor,
                        requantize: Callable[[torch.Tensor, int, int], torch.Tensor],
                        quantity: StoredQuantity | None) -> torch.Tensor:
        assert self.bits is not None
        out = requantize(flat.detach().contiguous(), self.bits[index], record_seed(self.base_seed, self.step, index))
        if index not in self.noise:
            self.noise[index] = squared_distance([out], [flat]) if quantity is None else \
                squared_distance([quantity.stored(out)], [quantity.stored(flat)])
        return out


def graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``loss.backward()`` would accumulate gradients into (its graph's leaves that require
    grad: the parameters, without ``model``), in a fixed order."""
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def squared_distance(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """``sum_i ||a_i - b_i||^2`` in float64 (``None`` counts as zeros)."""
    total = []
    for x, y in zip(a, b, strict=True):
        if x is None and y is None:
            continue
        if x is None:
            x = torch.zeros_like(y)
        if y is None:
            y = torch.zeros_like(x)
        total.append(squared_norm(x.detach().to(_wide(x.dtype)) - y.detach().to(_wide(y.dtype))))
    return math.fsum(total)


def calibrate(policy: BitPolicy, loss: torch.Tensor, *, step: int, group_size: int, base_seed: int,
              install: Callable[[CalibrationPass | None], None]) -> dict[str, float]:
    """Measure each slot class's correction on ``loss``'s graph and adopt them (``compress.calibrate``;
    see ``NOTE [ Calibration ]``). ``install(p)`` makes the context's unpack hook pass every decoded
    record through ``p.perturb`` (``None``: stop); ``base_seed`` is the context's rounding seed."""
    if not isinstance(policy, AutoBits):
        raise UnsupportedError("calibrate() corrects bits='auto''s importance estimate; this context has fixed bits")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
        raise InvalidArgumentError("calibrate() needs the scalar loss of a forward run under this context, "
                                   "before its backward")
    params = policy.params or graph_leaves(loss)
    if not params:
        raise UnsupportedError("calibrate() measures parameter gradients, and nothing in the loss's graph "
                               "requires grad; create the context with compress(model=...)")
    targets = policy.calibration_targets()
    seed = base_seed ^ _CALIBRATION_SEED

    def gradients(indices: dict[int, int], bits: Mapping[int, int] | None = None
                  ) -> tuple[list[torch.Tensor | None], CalibrationPass]:
        calibration_pass = CalibrationPass(indices, group_size, seed, step, bits)
        install(calibration_pass)
        try:
            with policy.ignoring_gradients():
                grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        finally:
            install(None)
        return list(grads), calibration_pass

    base, _ = gradients({})
    factors: dict[str, float] = {}
    perturbed = False
    for cls, members in targets.items():
        grads, done = gradients({key.index: key.numel for key, _ in members})
        perturbed = perturbed or bool(done.noise)
        predicted = math.fsum(s * done.noise.get(key.index, 0.0) for key, s in members)
        measured = squared_distance(grads, base)
        if predicted > 0 and measured > 0 and math.isfinite(measured):
            factors[cls] = measured / predicted
    if not perturbed:
        raise UnsupportedError("calibrate() found none of the allocation's saved tensors in this loss's graph: "
                               "compute the loss under this context, and call calibrate() before loss.backward()")
    gradient_sq = squared_distance(base, [None] * len(base))
    in_force = {a.key.index: a.bits for a in policy.report().slots}  # the bits this step's records have
    policy.set_calibration(factors, gradient_sq if math.isfinite(gradient_sq) else None)
    if policy.config.error_share is not None and math.isfinite(gradient_sq) and gradient_sq > 0:
        _verify(policy, in_force, gradients, base)
    final = policy.calibration
    return {cls: final[cls] for cls in factors}


# NOTE [ Verifying a variance target ]
# A class correction is measured with noise of one width (2 bits) and applied at every
# bit-width, and the classes are measured one at a time; where a backward is not linear in a record, or
# the noises of two classes compound through the layers below, the calibrated estimate of the whole
# allocation can still be low (docs/zoo.md has the models where it was). ``error_share`` is a bound,
# so ``calibrate`` then checks it on the same graph: one more backward in which every record the new
# allocation gives fewer bits than it has now is quantized again at its new bits, through its own
# op-aware encoding (a normalisation's input as normalised values with exact statistics: quantizing
# the restored values in plain groups would undo its exact constant rows and measure an error the
# real step does not make); the rest keep their estimated variance, which they add at most. When the
# measured share exceeds the bound, each class of the lowered records is measured alone the same way
# and its correction raised by its measured-to-estimated ratio where that exceeds 1 (when none does,
# their noises compound: every correction is raised by the whole allocation's ratio), and the
# allocation is solved again; at most ``_VERIFY_ROUNDS`` times.
_VERIFY_ROUNDS = 3


def _verify(policy: AutoBits, in_force: Mapping[int, int | None],
            gradients: Callable[..., tuple[list[torch.Tensor | None], CalibrationPass]],
            base: list[torch.Tensor | None]) -> None:
    bound = policy.variance_bound()
    assert bound is not None
    for _ in range(_VERIFY_ROUNDS):
        report = policy.report()
        assert report is not None
        lowered = [a for a in report.slots if a.bits is not None
                   and (in_force.get(a.key.index) is None or a.bits < in_force[a.key.index])]
        again = {a.key.index for a in lowered}
        measured = _measure(lowered, gradients, base) + math.fsum(a.variance for a in report.slots
                                                                  if a.key.index not in again)
        if measured <= bound or not lowered:
            return
        by_class: dict[str, list[SlotAllocation]] = {}
        for a in lowered:
            by_class.setdefault(a.slot_class, []).append(a)
        raised = {}
        for cls, members in by_class.items():
            estimated = math.fsum(a.variance for a in members)
            found = _measure(members, gradients, base)
            if estimated > 0 and found > estimated:
                raised[cls] = policy.class_correction(cls) * found / estimated
        if raised:
            policy.set_calibration(raised)
        elif report.quant_variance > 0:  # no class alone: their noises compound, see the NOTE
            policy.scale_calibration(measured / report.quant_variance)
        else:
            return


def _measure(slots: list[SlotAllocation], gradients: Callable[..., tuple[list[torch.Tensor | None], CalibrationPass]],
             base: list[torch.Tensor | None]) -> float:
    """The squared gradient error of quantizing ``slots``' records again at their allocated bits."""
    if not slots:
        return 0.0
    bits = {a.key.index: a.bits for a in slots if a.bits is not None}
    grads, _ = gradients({a.key.index: a.key.numel for a in slots}, bits)
    return squared_distance(grads, base)


class LossCatcher(EagerMode):
    """While entered, remembers the latest torch function output that is a floating-point scalar in the
    autograd graph: the loss, when it is computed under the context (``NOTE [ A variance target ]`` in
    ``policy.py``). Holds it weakly: a loss the caller dropped is not kept alive."""

    def __init__(self) -> None:
        super().__init__()
        self._latest: weakref.ref[torch.Tensor] | None = None

    def _handle(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if (isinstance(out, torch.Tensor) and out.grad_fn is not None and out.numel() == 1
                and out.is_floating_point()):
            self._latest = weakref.ref(out)
        return out

    def loss(self) -> torch.Tensor | None:
        """The latest scalar output still alive, or ``None``."""
        return self._latest() if self._latest is not None else None
