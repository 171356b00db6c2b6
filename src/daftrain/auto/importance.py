"""Importance of each saved tensor, and the per-tensor bit-widths of ``compress(bits="auto")``.

``AutoBits`` is the bit policy a ``compress`` context consults for every float tensor it quantizes. On
an *adaptation step* (the first step, every ``adapt_interval`` steps, and the step after the saved
tensors' shapes change) it measures each tensor's importance, then solves the bit allocation
(``allocation.py``) that the following steps use.

# NOTE [ Slots ]
# A saved tensor is identified across steps by its *slot*: ``(index, numel, dtype)``, ``index`` being
# the position of its record among the records the forward pass creates (bool masks included;
# parameters, tensors kept exact and deduplicated saves create none). The same model running the same
# code path saves the same sequence, so slot ``i`` is the same layer's same saved tensor every step. A
# slot whose ``(numel, dtype)`` differs from the allocation's, or an index past its end, means the
# shapes changed (another batch size or sequence length): that tensor gets the fallback bits
# (``avg_bits`` rounded down to a supported width; 1 with ``budget_bytes``) and the next step
# re-estimates. A ragged last batch therefore costs two re-estimations per epoch; drop it to avoid them.
#
# NOTE [ Importance estimate ]
# Quantizing saved tensor ``x_i`` adds zero-mean noise ``e_i`` (stochastic rounding is unbiased) to what
# backward reads, so the gradients get an extra variance ``V_i(b) ~= s_i * E||e_i||^2``:
#   1. ``E||e_i||^2`` at any bit-width follows from the group ranges (``NoiseProfile.energy``); the
#      ranges come from ``group_minmax`` over the tensor on the adaptation step (one read of it);
#   2. the noise reaches the gradients only through the backward of the op that *saved* ``x_i``, and
#      that backward scales it by the op's *output* gradient ``G`` (ActNN weighs a layer by
#      ``||dL/dy||^2`` of its output for the same reason). So ``s_i`` is read from ``G``, not from
#      ``dL/dx_i``: on an adaptation step a ``TorchFunctionMode`` (``_SaverTracer``, active only
#      during that step's forward) notes which records each torch function call creates (or saves
#      again, see ``NOTE [ One record per storage span ]``), and a prehook on the call's output
#      ``grad_fn`` adds ``||G||^2`` times the op's fan-out factor ``c`` to those records' ``s_i``:
#        - contractions (linear, matmul/mm/bmm/addmm/baddbmm, conv, two-operand einsum, sdpa):
#          ``y = x W`` gives the other operand's gradient the error ``G^T e``, of variance
#          ``||G||^2 / rows * E||e||^2``; ``c = 1 / rows``, ``rows = numel(x) / K`` with ``K`` the size
#          ``x`` is contracted over (``in_features``; ``C_in/groups * kernel`` for a convolution; ``A``'s
#          last and ``B``'s second-to-last dim of ``A @ B``; sdpa's head dim for q and k, the key
#          length for v, as for ``P @ V`` whose ``dV = P^T dO``);
#        - everything else (gelu, softmax, tanh, mul, dropout, norms' inputs, ...) has fan-out one:
#          value ``j`` of the saved tensor meets about one value of ``G``, so the error it adds to the
#          op's input gradient has variance ``~ ||G||^2 / m * E||e||^2``, ``c = 1 / m`` with
#          ``m = numel(y)``; when the output is smaller than the saved tensor (``m < n = numel(x)``, a
#          reduction such as a mean loss) each input meets ``G / (n/m)``, so ``c = m / n^2``;
#        - a normalisation's input (layer_norm, rms_norm, batch_norm) enters its backward only as
#          ``x_hat = (x - mean) * rstd``: the noise is scaled by ``rstd``, so ``c`` is multiplied by the
#          mean ``rstd^2`` (computed from the input on the adaptation step).
#      A tensor saved by several ops sums their terms. A record whose op's output has no ``grad_fn``,
#      or whose ``grad_fn`` receives no gradient, gets ``s_i = 0`` (its noise cannot reach a
#      gradient); one created outside any traced call (e.g. inside a custom ``autograd.Function``)
#      gets the median of the others.
# The error of a contraction lands directly in a parameter's gradient; that of a fan-out-one op lands
# in an activation gradient and reaches the parameters through the backward of the layers before it;
# the estimate counts it at that first landing, not through the rest of the network (doing so exactly
# would need a backward per tensor). ``tests/test_importance.py`` compares ``V_i`` with the variance
# measured over repeated quantized backward passes on a small MLP.
# The estimate costs no extra forward or backward pass (GACT runs three per tensor): on an adaptation
# step, one min/max read per saved tensor, one Python call per torch function of the forward and one
# squared-norm per traced op output in backward, amortised over ``adapt_interval`` steps
# (``benchmarks/bench_importance_overhead.py`` measures it). ``V_i`` is an order-of-magnitude estimate
# of the true variance; the allocation only needs it to rank tensors. Across op kinds it is not even
# that (noise landing in an activation gradient is undercounted by orders of magnitude):
# ``compress.calibrate`` measures a correction per class of slots, see ``NOTE [ Calibration ]`` in
# ``calibration.py``.
#
# NOTE [ Fewest bits ]
# The variance model above holds when the backward that reads a saved tensor is *linear* in it
# (contractions, ``mul``): unbiased rounding then gives an unbiased gradient. A nonlinear backward
# (GELU's ``gelu'(x)``, softmax's and tanh's products of their outputs, a norm's ``rstd``) turns the
# rounding noise into a bias of the order of ``f'' * E[e^2]`` that does not average out over steps and
# that ``V_i`` does not count (``policy.py``, ``NOTE [ Nonlinear backward ]``). At 1 bit a group keeps
# two levels, its min and max, and the bias is of the order of the values themselves. So a tensor saved
# by any op outside ``_LINEAR_SAVERS`` gets at least ``NONLINEAR_SAVER_MIN_BITS`` (2, what fixed
# 2-bit gives it) and the allocation cannot buy bytes for others by dropping it to 1 bit. So does a
# tensor with zero-exact groups (min exactly 0: ReLU outputs, dropped-out or causally masked attention
# probabilities): at 1 bit such a group has a single positive level, the midpoint of its positive
# range (``layout.py``), so every positive value is *replaced*, not rounded without bias (tiny
# probabilities become half the largest one). So does an operand of a *contraction of two
# activations* (``q @ k^T`` and ``P @ V`` of attention: matmul/bmm/einsum/sdpa whose every operand is
# computed by the forward, none a parameter, a view of one, a constant or an input). Its backward is
# linear in it and its variance is estimated and calibrated like any other, yet that variance misses
# what 1 bit does there: on the character GPT-2 of ``benchmarks/bench_accuracy_parity.py`` the
# calibrated allocation put most of q, k and v at 1 bit and ended 6.5% above FP32's validation loss,
# against 0.2% with this floor at the same bytes; the loss curves part from step 300, where attention
# starts to be learned. (Flooring every product of two activations, GELU's ``mul`` included, did not
# help further: 1.1%.) A treatment's own floor (``policy.decide``: 8 for log_softmax's output) is a
# floor here too, so the allocation counts the bytes the record will really take. A budget that
# cannot hold every tensor at its floor (``avg_bits`` below 2) drops the floors and allocates from
# 1 bit for all.
#
# NOTE [ Variance warning ]
# Given the model, the adaptation step and the step after it also record the parameter gradients;
# ``||g_t - g_{t+1}||^2 / 2`` estimates the minibatch gradient's variance (two independent draws of it,
# quantization noise included). When ``sum_i V_i(b_i)`` exceeds ``variance_warning`` times that, a
# ``QuantizationVarianceWarning`` says so (GACT warns at 0.1 the same way). One copy of the trainable
# parameters' gradients is held between those two steps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import CompressionConfig
from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from ..layout import SUPPORTED_BITS
from ..params import ParameterRegistry, is_parameter_like
from .allocation import Choice, NoiseProfile, budget_for_avg_bits, choices_for, solve

__all__ = ["AllocationReport", "AutoBits", "QuantizationVarianceWarning", "SlotAllocation", "SlotKey",
           "StateDictError"]

STATE_FORMAT = "daftrain.compress"
STATE_VERSION = 3


class QuantizationVarianceWarning(UserWarning):
    """The estimated quantization variance is a large share of the gradient's own variance."""


class StateDictError(InvalidArgumentError):
    """A state dict that does not belong to this context (another model or config) or is corrupted."""


@dataclass(frozen=True, order=True)
class SlotKey:
    """A saved tensor's identity across steps; see ``NOTE [ Slots ]``."""

    index: int
    numel: int
    dtype: str


@dataclass(frozen=True)
class SlotEstimate:
    """What an adaptation step measured of one slot: the input of the allocation."""

    key: SlotKey
    shape: tuple[int, ...]
    itemsize: int
    op: str
    """The torch function(s) that saved the tensor on the adaptation step, ``+``-joined (``""`` if none)."""
    producer: str
    """The autograd node that produced the tensor (views skipped; ``""`` for none)."""
    grad_sq: float | None
    """``||G||^2`` of the saving ops' output gradients on the adaptation step; ``None`` when none arrived."""
    noise: NoiseProfile
    sensitivity: float
    """The analytic estimate; see ``NOTE [ Importance estimate ]``."""
    min_bits: int
    """The fewest bits it may get; see ``NOTE [ Fewest bits ]``."""

    @property
    def slot_class(self) -> str:
        """Slots of one class share a calibration: same saving op(s), producer and size."""
        return f"{self.op}|{self.producer}|{self.key.numel}"


@dataclass(frozen=True)
class SlotAllocation(SlotEstimate):
    """One slot's importance estimate and its allocated bits (``None`` = kept exact)."""

    calibration: float
    """The measured correction of its class (1.0 until ``calibrate``); see ``NOTE [ Calibration ]``."""
    bits: int | None
    nbytes: int
    variance: float
    """Estimated gradient variance the slot adds at ``bits`` (``sensitivity * calibration * noise.energy(bits)``)."""


@dataclass(frozen=True)
class AllocationReport:
    """The allocation in force: per slot importance and bits, and the budget; ``str()`` is a table."""

    estimated_at_step: int
    next_adapt_step: int
    budget_bytes: int
    used_bytes: int
    slots: tuple[SlotAllocation, ...]
    quant_variance: float
    grad_variance: float | None
    """Minibatch gradient variance measured around the last adaptation (needs ``model``)."""

    @property
    def avg_bits(self) -> float:
        """Stored bits per value over the allocated slots, per-group overhead included."""
        numel = sum(s.key.numel for s in self.slots)
        return 8 * self.used_bytes / numel if numel else 0.0

    @property
    def variance_share(self) -> float | None:
        if self.grad_variance is None or self.grad_variance <= 0:
            return None
        return self.quant_variance / self.grad_variance

    def to_dict(self) -> dict[str, Any]:
        return {
            "estimated_at_step": self.estimated_at_step, "next_adapt_step": self.next_adapt_step,
            "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes, "avg_bits": self.avg_bits,
            "quant_variance": self.quant_variance, "grad_variance": self.grad_variance,
            "variance_share": self.variance_share,
            "slots": [
                {"index": s.key.index, "shape": list(s.shape), "dtype": s.key.dtype, "numel": s.key.numel,
                 "op": s.op, "producer": s.producer, "min_bits": s.min_bits, "bits": s.bits, "nbytes": s.nbytes,
                 "sensitivity": s.sensitivity, "calibration": s.calibration, "variance": s.variance}
                for s in self.slots
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        lines = [f"{'slot':>5} {'shape':<22} {'dtype':<9} {'saved by':<24} {'sensitivity':>11} {'calib.':>9} "
                 f"{'bits':>5} {'bytes':>11} {'est. var':>10}"]
        for s in self.slots:
            bits = "exact" if s.bits is None else str(s.bits)
            lines.append(f"{s.key.index:>5} {'x'.join(map(str, s.shape)):<22} {s.key.dtype:<9} {s.op[:24]:<24} "
                         f"{s.sensitivity:>11.3e} {s.calibration:>9.3g} {bits:>5} {s.nbytes:>11,} "
                         f"{s.variance:>10.3e}")
        share = self.variance_share
        lines.append(
            f"{len(self.slots)} slots, {self.used_bytes:,} of {self.budget_bytes:,} budget bytes "
            f"({self.avg_bits:.2f} bits/value); est. quantization variance {self.quant_variance:.3e}"
            + (f", {share:.1%} of the gradient variance" if share is not None else "")
            + f"; estimated at step {self.estimated_at_step}, next at {self.next_adapt_step}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass
class _Observation:
    key: SlotKey
    shape: tuple[int, ...]
    itemsize: int
    noise: NoiseProfile
    min_bits: int = 1
    producer: str = ""
    ops: list[str] = dataclasses.field(default_factory=list)
    grad_sq: float | None = None
    """Sum of ``||G||^2`` over the saving ops' output gradients that arrived."""
    sensitivity: float = 0.0
    """Sum of ``c * ||G||^2`` over the same; see ``NOTE [ Importance estimate ]``."""
    traced: bool = False
    """A traced torch function call saved it."""
    activation_product: bool = False
    """A contraction of two activations saved it; see ``NOTE [ Fewest bits ]``."""
    hooked: bool = False
    """A prehook waits for the output gradient of an op that saved it."""


# Torch functions whose backward is linear in every tensor they save; see NOTE [ Fewest bits ].
_LINEAR_SAVERS = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
    "conv1d", "conv2d", "conv3d", "mul", "__mul__", "__rmul__", "mul_", "__imul__", "multiply",
})
NONLINEAR_SAVER_MIN_BITS = 2


# Contractions that can multiply two activations; see NOTE [ Fewest bits ].
_CONTRACTIONS = frozenset({
    "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addbmm", "einsum",
    "scaled_dot_product_attention",
})


def _activation_product(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                        registry: ParameterRegistry) -> bool:
    """``name`` contracts tensors all of which the forward computed (none a parameter, a cast or view
    of one, a constant or an input); see ``NOTE [ Fewest bits ]``."""
    if name not in _CONTRACTIONS:
        return False
    if name in ("baddbmm", "addbmm"):  # the added term is not contracted
        args, kwargs = args[1:], {k: v for k, v in kwargs.items() if k != "input"}
    operands = _tensors(list(args) + list(kwargs.values()))
    return len(operands) >= 2 and all(t.grad_fn is not None and not is_parameter_like(t, registry)
                                      for t in operands)


def _floor_bits(ops: list[str], min_bits: int, noise: NoiseProfile, activation_product: bool = False) -> int:
    """The fewest bits a tensor saved by ``ops`` may get; see ``NOTE [ Fewest bits ]``."""
    if any(op not in _LINEAR_SAVERS for op in ops) or noise.zero_r2 > 0 or activation_product:
        return max(min_bits, NONLINEAR_SAVER_MIN_BITS)
    return min_bits


# Normalisations whose input reaches their backward scaled by rstd; see NOTE [ Importance estimate ].
_NORMS = frozenset({"layer_norm", "rms_norm", "batch_norm"})


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _same_storage(a: Any, b: torch.Tensor) -> bool:
    if not isinstance(a, torch.Tensor):
        return False
    try:
        pa = a.untyped_storage().data_ptr()
        return pa != 0 and pa == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False


def _arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _ab_contracted(a: Any, b: Any, saved: torch.Tensor) -> int | None:
    """``K`` for the saved operand of ``a @ b``: ``a``'s last dim, ``b``'s second-to-last."""
    if _same_storage(a, saved) and a.dim() >= 1:
        return int(a.shape[-1])
    if _same_storage(b, saved) and b.dim() >= 1:
        return int(b.shape[-2] if b.dim() >= 2 else b.shape[0])
    return None


def _einsum_contracted(args: tuple[Any, ...], saved: torch.Tensor) -> int | None:
    if not args or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
        return None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    lhs, out = args[0].replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(operands) != 2 or len(terms) != 2:
        return None
    for term, op in zip(terms, operands, strict=True):
        if _same_storage(op, saved) and op.dim() == len(term):
            return math.prod(int(n) for c, n in zip(term, op.shape, strict=True) if c not in out)
    return None


def _contracted(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], saved: torch.Tensor) -> int | None:
    """The size ``K`` the saved tensor is contracted over by op ``name``, or ``None`` when it is not a
    contraction operand (``rows = numel / K``); see ``NOTE [ Importance estimate ]``."""
    if name == "linear":
        x = _arg(args, kwargs, 0, "input")
        return int(x.shape[-1]) if _same_storage(x, saved) and x.dim() >= 1 else None
    if name in ("matmul", "__matmul__", "mm", "bmm"):
        return _ab_contracted(_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "mat2")
                              if name in ("mm", "bmm") else _arg(args, kwargs, 1, "other"), saved)
    if name == "__rmatmul__":
        return _ab_contracted(_arg(args, kwargs, 1, "other"), args[0] if args else None, saved)
    if name in ("addmm", "baddbmm", "addbmm"):
        first, second = ("mat1", "mat2") if name == "addmm" else ("batch1", "batch2")
        return _ab_contracted(_arg(args, kwargs, 1, first), _arg(args, kwargs, 2, second), saved)
    if name in ("conv1d", "conv2d", "conv3d"):
        x, w = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        if _same_storage(x, saved) and isinstance(w, torch.Tensor) and w.dim() >= 2:
            return int(w.shape[1]) * math.prod(int(k) for k in w.shape[2:])
        return None
    if name == "einsum":
        return _einsum_contracted(args, saved)
    if name == "scaled_dot_product_attention":
        q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        if _same_storage(q, saved) or _same_storage(k, saved):
            t = q if _same_storage(q, saved) else k
            return int(t.shape[-1])
        if _same_storage(v, saved) and v.dim() >= 2:
            return int(v.shape[-2])
    return None


def _mean_rstd_sq(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> float:
    """Mean ``rstd^2`` a normalisation applies to its input (1.0 when it cannot tell)."""
    x = _arg(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or not x.is_floating_point():
        return 1.0
    with torch.no_grad():
        x = x.detach().double()
        if name == "batch_norm":
            if x.dim() < 2:
                return 1.0
            var = x.transpose(0, 1).reshape(x.shape[1], -1).var(1, unbiased=False)
        else:
            shape = _arg(args, kwargs, 1, "normalized_shape")
            n = 1 if isinstance(shape, int) else len(shape) if shape is not None else 1
            dims = tuple(range(-n, 0))
            var = x.var(dims, unbiased=False) if name == "layer_norm" else x.pow(2).mean(dims)
        return float((1.0 / (var + 1e-5)).mean())


def _fan_out(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], saved: torch.Tensor,
             numel_out: int) -> float:
    """The factor ``c`` with ``s = c * ||G||^2``; see ``NOTE [ Importance estimate ]``."""
    k = _contracted(name, args, kwargs, saved)
    if k is not None:
        return k / max(1, saved.numel())
    n, m = max(1, saved.numel()), max(1, numel_out)
    c = 1.0 / m if m >= n else m / n**2  # a reduction shares each output's G among n/m inputs
    if name in _NORMS and _same_storage(_arg(args, kwargs, 0, "input"), saved):
        c *= _mean_rstd_sq(name, args, kwargs)
    return c


def _attribute(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any,
               saved: list[tuple[_Observation, torch.Tensor]], policy: AutoBits) -> None:
    """Hook the output gradient of one traced call onto the records it saved."""
    name = getattr(func, "__name__", None) or str(func)
    outs = _tensors(out)
    numel_out = sum(t.numel() for t in outs)
    contribs = []
    activation_product = _activation_product(name, args, kwargs, policy.registry)
    for obs, tensor in saved:
        obs.traced = True
        obs.activation_product = obs.activation_product or activation_product
        if name not in obs.ops:
            obs.ops.append(name)
        contribs.append((obs, _fan_out(name, args, kwargs, tensor, numel_out)))
    nodes = []
    for t in outs:
        node = t.grad_fn if t.requires_grad else None
        if node is not None and all(node is not n for n in nodes):
            nodes.append(node)
    if not nodes:
        return  # no gradient can reach these records through this op: it adds 0 to their sensitivity

    def on_grad(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        if policy.calibrating:  # calibrate()'s extra backward passes are not the step's gradient
            return
        sq = math.fsum(float(torch.linalg.vector_norm(g.detach(), dtype=torch.float64) ** 2)
                       for g in grad_outputs if g is not None)
        for obs, c in contribs:
            obs.grad_sq = sq if obs.grad_sq is None else obs.grad_sq + sq
            obs.sensitivity += c * sq

    for node in nodes:
        node.register_prehook(on_grad)
    for obs, _ in contribs:
        obs.hooked = True


# Autograd nodes that only re-view their input: the producer of a saved view is the node behind them.
_VIEW_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0",
    "ReshapeAliasBackward0", "AliasBackward0", "TBackward0", "SplitBackward0", "SplitWithSizesBackward0",
    "SliceBackward0", "SelectBackward0", "AsStridedBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "UnsqueezeBackward0", "UnbindBackward0",
})


def _producer(t: torch.Tensor | None) -> str:
    """The name of the autograd node that computed ``t``, views skipped (``""`` for a leaf or none)."""
    node = t.grad_fn if t is not None else None
    for _ in range(8):
        if node is None:
            return ""
        name = type(node).__name__
        if name not in _VIEW_NODES:
            return name
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return name
        node = inputs[0]
    return type(node).__name__ if node is not None else ""


class _SaverTracer(TorchFunctionMode):
    """Active during an adaptation step's forward: attributes each record to the call that saved it."""

    def __init__(self, policy: AutoBits) -> None:
        super().__init__()
        self._policy = policy

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        saved = self._policy._saved_in_call
        start = len(saved)
        out = func(*args, **kwargs)  # the mode is off inside: nested calls belong to this one
        if len(saved) > start:
            mine = saved[start:]
            del saved[start:]
            _attribute(func, args, kwargs, out, mine, self._policy)
        return out


class _GradProbe:
    """Records the model's trainable gradients on two consecutive steps; see ``NOTE [ Variance warning ]``."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._first: dict[int, torch.Tensor] = {}
        self._diff_sq = 0.0
        self._phase = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self._phase == 0:
            self._first[id(p)] = p.grad.detach().clone()
        elif id(p) in self._first:
            first = self._first.pop(id(p))
            self._diff_sq += float(torch.linalg.vector_norm(p.grad.detach() - first, dtype=torch.float64) ** 2)

    def next_step(self) -> float | None:
        """Move to the second step; after it, return the variance estimate and stop listening."""
        self._phase += 1
        if self._phase == 1:
            return None
        self.remove()
        return self._diff_sq / 2

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._first = [], {}


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the model's parameter names, shapes and dtypes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return h.hexdigest()[:16]


def _checksum(payload: Mapping[str, Any]) -> int:
    return zlib.crc32(json.dumps(payload, sort_keys=True, allow_nan=True).encode())


class AutoBits:
    """The bit policy of ``compress(bits="auto")``; see the module docstring and its NOTEs."""

    def __init__(self, config: CompressionConfig, model: nn.Module | None = None) -> None:
        if not config.auto:
            raise InvalidArgumentError(f"AutoBits needs CompressionConfig(bits='auto'), got bits={config.bits!r}")
        self.config = config
        self._params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self.registry = ParameterRegistry(model)
        """The model's parameter and buffer storages: operands that are not activations."""
        self._fingerprint = model_fingerprint(model) if model is not None else None
        if config.budget_bytes is not None:
            self.avg_bits: float | None = None
            self._fallback = 1
        else:
            self.avg_bits = float(config.avg_bits) if config.avg_bits is not None else 2.0
            self._fallback = max(b for b in SUPPORTED_BITS if b <= self.avg_bits)
        self._step = -1
        self._adapt_step = -1
        self._next_adapt = 0
        self._adapting = False
        self._reestimate = False
        self._observed: dict[SlotKey, _Observation] = {}
        self._by_index: dict[int, _Observation] = {}
        self._saved_in_call: list[tuple[_Observation, torch.Tensor]] = []
        self._tracer: _SaverTracer | None = None
        self._pending = False
        self._bits: dict[SlotKey, int | None] = {}
        self._report: AllocationReport | None = None
        self._probe: _GradProbe | None = None
        self._grad_variance: float | None = None
        self._slot_variance: tuple[AllocationReport, dict[SlotKey, float]] | None = None
        self._calibration: dict[str, float] = {}
        self.calibrating = False
        """Set while ``compress.calibrate`` runs its extra backward passes: the estimate ignores them."""

    @property
    def params(self) -> list[nn.Parameter]:
        """The model's trainable parameters (empty without ``model``)."""
        return self._params

    # -- tracing the saving ops (adaptation steps) ---------------------------------------------------
    def enter(self, step: int) -> None:
        """The forward of ``step`` starts: trace it when it may adapt (see ``NOTE [ Importance estimate ]``)."""
        if self._tracer is not None:
            self.exit()
        if step != self._step and self._pending and self._complete():
            self._finalize()  # what the step's first record would do; its backward is over
        may_adapt = (self._adapting if step == self._step
                     else self._pending or self._reestimate or step >= self._next_adapt)
        if may_adapt:
            self._tracer = _SaverTracer(self)
            self._tracer.__enter__()

    def exit(self) -> None:
        """The forward ends: stop tracing."""
        tracer, self._tracer = self._tracer, None
        if tracer is not None:
            tracer.__exit__(None, None, None)
        self._saved_in_call = []

    def note_saved_again(self, step: int, index: int, source: torch.Tensor) -> None:
        """The record at forward position ``index`` was saved once more (deduplicated) by another op."""
        if self._adapting and step == self._step and self._tracer is not None:
            obs = self._by_index.get(index)
            if obs is not None:
                self._saved_in_call.append((obs, source))

    # -- the per-tensor decision -------------------------------------------------------------------
    def bits_for(self, step: int, index: int, source: torch.Tensor | None, flat: torch.Tensor,
                 min_bits: int = 1) -> int | None:
        """Bits for the record at forward position ``index`` of ``step`` (``None`` = keep exact);
        ``min_bits`` is the floor the saved tensor's treatment sets (``policy.decide``)."""
        if step != self._step:
            self._new_step(step)
        key = SlotKey(index, flat.numel(), str(flat.dtype).removeprefix("torch."))
        if self._adapting:
            self._observe(key, source, flat, min_bits)
        if key in self._bits:
            return self._bits[key]
        if self._bits and not self._adapting:
            self._reestimate = True  # shapes changed: see NOTE [ Slots ]
        return self._fallback

    def _new_step(self, step: int) -> None:
        self._step = step
        if self._pending:
            self._finalize()
        if self._probe is not None:
            variance = self._probe.next_step()
            if variance is not None:
                self._probe = None
                self._grad_variance = variance
                self._check_variance()
        self._adapting = self._reestimate or step >= self._next_adapt
        if self._adapting:
            self._adapt_step = step
            self._reestimate = False
            self._observed, self._by_index = {}, {}
            self._pending = True
            if self._params and self._probe is None:
                self._probe = _GradProbe(self._params)

    def _observe(self, key: SlotKey, source: torch.Tensor | None, flat: torch.Tensor, min_bits: int = 1) -> None:
        group = self.config.group_size
        with torch.no_grad():
            stats = torch.ops.daftrain.group_minmax(flat.detach(), group).double()
        mn, mx, min_pos = stats.unbind(1)
        sizes = torch.full_like(mn, group)
        sizes[-1] = flat.numel() - group * (mn.numel() - 1)
        zero = (mn == 0) & (mx > 0)
        plain_r2 = float((sizes * (mx - mn) ** 2)[~zero].sum())
        zero_r2 = float((sizes * (mx - min_pos) ** 2)[zero].sum())
        shape = tuple(source.shape) if source is not None else (flat.numel(),)
        obs = _Observation(key, shape, flat.element_size(), NoiseProfile(plain_r2, zero_r2), min_bits,
                           _producer(source))
        self._observed[key] = obs
        self._by_index[key.index] = obs
        if source is not None and self._tracer is not None:
            self._saved_in_call.append((obs, source))

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
            else:  # saved by traced ops whose outputs got no gradient: its noise cannot reach one either
                sens.append(0.0 if o.traced else default)
        self._apply([SlotEstimate(o.key, o.shape, o.itemsize, "+".join(o.ops), o.producer, o.grad_sq, o.noise, s,
                                  _floor_bits(o.ops, o.min_bits, o.noise, o.activation_product))
                     for o, s in zip(observed, sens, strict=True)],
                    estimated_at=self._adapt_step, next_adapt=self._adapt_step + self.config.adapt_interval)

    def _budget(self, numels: list[int]) -> int:
        if self.config.budget_bytes is not None:
            return self.config.budget_bytes
        assert self.avg_bits is not None
        return budget_for_avg_bits(numels, self.avg_bits, self.config.group_size)

    def _solve(self, slots: list[SlotEstimate], estimated_at: int, next_adapt: int,
               grad_variance: float | None) -> tuple[dict[SlotKey, int | None], AllocationReport]:
        """The allocation for ``slots`` under the calibration in force; pure."""
        group = self.config.group_size
        unmeasured = self._unmeasured_calibration()
        factors = [self._calibration.get(e.slot_class, unmeasured) for e in slots]

        def choices(floored: bool) -> list[tuple[Choice, ...]]:
            return [choices_for(e.key.numel, e.itemsize, group, e.noise, e.sensitivity * f,
                                min_bits=e.min_bits if floored else 1)
                    for e, f in zip(slots, factors, strict=True)]

        items = choices(floored=True)
        budget = self._budget([e.key.numel for e in slots])
        if sum(c[0].nbytes for c in items) > budget:  # a budget below the floors: NOTE [ Fewest bits ]
            items = choices(floored=False)
        solution = solve(items, budget)
        allocated = []
        for e, f, c, pick in zip(slots, factors, items, solution.picks, strict=True):
            ch = c[pick]
            estimate = {field.name: getattr(e, field.name) for field in dataclasses.fields(SlotEstimate)}
            allocated.append(SlotAllocation(**estimate, calibration=f, bits=ch.bits, nbytes=ch.nbytes,
                                            variance=ch.variance))
        report = AllocationReport(estimated_at, next_adapt, budget, solution.nbytes, tuple(allocated),
                                  solution.variance, grad_variance)
        return {a.key: a.bits for a in allocated}, report

    def _apply(self, slots: list[SlotEstimate], estimated_at: int, next_adapt: int) -> None:
        self._bits, self._report = self._solve(slots, estimated_at, next_adapt, self._grad_variance)
        self._next_adapt = next_adapt

    # -- calibration (see NOTE [ Calibration ]) ------------------------------------------------------
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

    def set_calibration(self, factors: Mapping[str, float]) -> None:
        """Adopt measured class corrections and re-solve the allocation in force with them."""
        for cls, f in factors.items():
            if not (isinstance(f, float) and math.isfinite(f) and f > 0):
                raise InvalidArgumentError(f"calibration of {cls!r} must be a positive finite float, got {f!r}")
        self._calibration.update(factors)
        report = self._report
        if report is not None:
            self._bits, self._report = self._solve(list(report.slots), report.estimated_at_step,
                                                   report.next_adapt_step, self._grad_variance)

    def importance_of(self, index: int, flat: torch.Tensor) -> float | None:
        """The estimated gradient variance the record at forward position ``index`` adds at its
        allocated bits (``None`` before the first allocation, or for a slot it does not know).

        This is what a ``PagePool`` evicts by: demoting a record multiplies its variance by the same
        factor for any slot, so the records that add least variance are the cheapest to demote."""
        report = self._report
        if report is None:
            return None
        key = SlotKey(index, flat.numel(), str(flat.dtype).removeprefix("torch."))
        if self._slot_variance is None or self._slot_variance[0] is not report:
            self._slot_variance = (report, {a.key: a.variance for a in report.slots})
        return self._slot_variance[1].get(key)

    def _check_variance(self) -> None:
        report, var = self._report, self._grad_variance
        if report is None or var is None:
            return
        self._report = dataclasses.replace(report, grad_variance=var)
        if var > 0 and report.quant_variance > self.config.variance_warning * var:
            warnings.warn(
                f"daftrain: the estimated quantization variance ({report.quant_variance:.3e}) is "
                f"{report.quant_variance / var:.1%} of the minibatch gradient variance ({var:.3e}), above the "
                f"{self.config.variance_warning:.0%} threshold; training may converge worse. Raise avg_bits "
                "(or budget_bytes), or lower the learning rate; ctx.report() lists the tensors.",
                QuantizationVarianceWarning, stacklevel=2,
            )

    # -- visibility and persistence ----------------------------------------------------------------
    def report(self) -> AllocationReport | None:
        """The allocation in force (``None`` before the first adaptation step's backward)."""
        if self._pending and self._complete():
            self._finalize()
        return self._report

    def state_dict(self, step: int) -> dict[str, Any]:
        if self._pending:
            if not self._complete():
                raise UnsupportedError(
                    "state_dict() was called between the forward and the backward of an adaptation step; "
                    "call it after loss.backward() so the saved state holds that step's estimate"
                )
            self._finalize()
        slots = []
        if self._report is not None:
            for a in self._report.slots:
                slots.append({
                    "index": a.key.index, "numel": a.key.numel, "dtype": a.key.dtype, "shape": list(a.shape),
                    "itemsize": a.itemsize, "op": a.op, "producer": a.producer, "min_bits": a.min_bits,
                    "grad_sq": a.grad_sq,
                    "plain_r2": a.noise.plain_r2,
                    "zero_r2": a.noise.zero_r2, "sensitivity": a.sensitivity, "bits": a.bits,
                })
        payload: dict[str, Any] = {
            "format": STATE_FORMAT, "version": STATE_VERSION, "step": step,
            "config": self._config_dict(), "model": self._fingerprint,
            "next_adapt": self._next_adapt, "reestimate": self._reestimate,
            "estimated_at": self._report.estimated_at_step if self._report is not None else None,
            "grad_variance": self._grad_variance, "calibration": dict(self._calibration), "slots": slots,
        }
        return {**payload, "checksum": _checksum(payload)}

    @staticmethod
    def fixed_state_dict(config: CompressionConfig, step: int) -> dict[str, Any]:
        """The state of a context with fixed bits: its step counter (the rounding seeds follow it)."""
        payload = {"format": STATE_FORMAT, "version": STATE_VERSION, "step": step,
                   "config": {"bits": config.bits, "group_size": config.group_size}}
        return {**payload, "checksum": _checksum(payload)}

    @staticmethod
    def load_fixed_state_dict(config: CompressionConfig, state: Mapping[str, Any]) -> int:
        """Validate a fixed-bits state; returns its step."""
        _check_envelope(state)
        want = {"bits": config.bits, "group_size": config.group_size}
        if state.get("config") != want:
            raise _refuse(f"it was saved with {state.get('config')}, this context has {want}")
        if isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int):
            raise _refuse("step must be an int")
        return state["step"]

    def _config_dict(self) -> dict[str, Any]:
        c = self.config
        return {"group_size": c.group_size, "avg_bits": self.avg_bits, "budget_bytes": c.budget_bytes,
                "adapt_interval": c.adapt_interval}

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Validate ``state`` completely, then apply it; returns its step. Nothing changes on error."""
        parsed = self._validate(state)
        slots, estimated_at = parsed["slots"], parsed["estimated_at"]
        bits: dict[SlotKey, int | None] = {}
        report = None
        current = self._calibration
        self._calibration = parsed["calibration"]
        try:
            if slots:
                bits, report = self._solve([e for e, _ in slots], estimated_at, state["next_adapt"],
                                           parsed["grad_variance"])
                if bits != {e.key: b for e, b in slots}:
                    raise StateDictError("cannot load this daftrain state dict: its bits do not follow from its "
                                         "importance estimates (corrupted, or saved by another daftrain version); "
                                         "nothing was changed")
        except BaseException:
            self._calibration = current
            raise
        self._bits, self._report, self._grad_variance = bits, report, parsed["grad_variance"]
        self._next_adapt, self._reestimate = state["next_adapt"], state["reestimate"]
        self._step = state["step"]
        self._pending, self._observed, self._by_index, self._adapting = False, {}, {}, False
        return state["step"]

    def _validate(self, state: Mapping[str, Any]) -> dict[str, Any]:
        fail = _refuse
        _check_envelope(state)
        if state.get("config") != self._config_dict():
            raise fail(f"it was saved with {state.get('config')}, this context has {self._config_dict()}")
        if self._fingerprint is not None and state.get("model") is not None and state["model"] != self._fingerprint:
            raise fail(f"it belongs to another model (parameter fingerprint {state['model']}, this model "
                       f"{self._fingerprint})")
        for name in ("step", "next_adapt"):
            if isinstance(state.get(name), bool) or not isinstance(state.get(name), int):
                raise fail(f"{name} must be an int")
        if not isinstance(state.get("reestimate"), bool):
            raise fail("reestimate must be a bool")
        raw = state.get("slots")
        if not isinstance(raw, list):
            raise fail("slots must be a list")
        slots = []
        try:
            for s in raw:
                key = SlotKey(int(s["index"]), int(s["numel"]), str(s["dtype"]))
                bits = s["bits"]
                if bits is not None and bits not in SUPPORTED_BITS:
                    raise InvalidArgumentError(f"bits {bits!r}")
                grad_sq = None if s["grad_sq"] is None else float(s["grad_sq"])
                if not isinstance(s["op"], str) or not isinstance(s["producer"], str):
                    raise ArgumentTypeError(f"op {s['op']!r}, producer {s['producer']!r}")
                if s["min_bits"] not in SUPPORTED_BITS or isinstance(s["min_bits"], bool):
                    raise InvalidArgumentError(f"min_bits {s['min_bits']!r}")
                noise = NoiseProfile(float(s["plain_r2"]), float(s["zero_r2"]))
                values = (float(s["sensitivity"]), noise.plain_r2, noise.zero_r2)
                if not all(math.isfinite(v) and v >= 0 for v in values) or key.numel <= 0:
                    raise InvalidArgumentError("negative or non-finite estimate")
                slots.append((SlotEstimate(key, tuple(int(d) for d in s["shape"]), int(s["itemsize"]), s["op"],
                                           s["producer"], grad_sq, noise, float(s["sensitivity"]), s["min_bits"]),
                              bits))
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"a slot entry is malformed ({e!r})") from None
        if len({e.key.index for e, _ in slots}) != len(slots):
            raise fail("two slots share one index")
        if self._bits and slots and set(self._bits) != {e.key for e, _ in slots}:
            raise fail("its slots (saved tensors) differ from the ones this context has seen; "
                       "it belongs to another model")
        if slots and not isinstance(state.get("estimated_at"), int):
            raise fail("estimated_at must be an int")
        variance = state.get("grad_variance")
        if variance is not None and (isinstance(variance, bool) or not isinstance(variance, int | float)
                                     or not math.isfinite(variance) or variance < 0):
            raise fail("grad_variance must be None or a non-negative number")
        calibration = state.get("calibration")
        if not isinstance(calibration, dict) or not all(
            isinstance(k, str) and isinstance(v, float) and math.isfinite(v) and v > 0 for k, v in calibration.items()
        ):
            raise fail("calibration must map slot classes to positive finite floats")
        return {"slots": slots, "estimated_at": state.get("estimated_at"), "grad_variance": variance,
                "calibration": dict(calibration)}


def _refuse(why: str) -> StateDictError:
    return StateDictError(f"cannot load this daftrain state dict: {why}; nothing was changed")


def _check_envelope(state: Mapping[str, Any]) -> None:
    """Format, version and checksum of a state dict."""
    if not isinstance(state, Mapping):
        raise _refuse(f"expected a mapping, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise _refuse(f"format {state.get('format')!r} version {state.get('version')!r} is not "
                      f"{STATE_FORMAT!r} version {STATE_VERSION}")
    payload = {k: v for k, v in state.items() if k != "checksum"}
    try:
        ok = state.get("checksum") == _checksum(payload)
    except (TypeError, ValueError) as e:
        raise _refuse(f"it is not serialisable ({e})") from None
    if not ok:
        raise _refuse("its checksum does not match its contents (corrupted or edited)")
