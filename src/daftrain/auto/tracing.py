"""Which torch function saved each record, and how its output gradient scales that record's noise: the
measurement half of ``bits="auto"``'s importance estimate (``policy.py`` turns it into bits)."""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..callbacks import EagerMode
from ..calls import argument as _arg
from ..kernels import ops as kernel_ops
from ..lineage import copy_of
from ..params import ParameterRegistry, is_parameter_like
from .allocation import MEASURED_BITS, NoiseProfile
from .report import SlotKey
from .variance import squared_norm

__all__ = ["NONLINEAR_SAVER_MIN_BITS", "Observation", "SaveTracer", "floor_bits", "nonlinear_saver", "observe"]


@dataclass
class Observation:
    """What an adaptation step's forward and backward measure of one record."""

    key: SlotKey
    shape: tuple[int, ...]
    itemsize: int
    noise: NoiseProfile
    min_bits: int = 1
    producer: str = ""
    ops: list[str] = field(default_factory=list)
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
    rewritten: bool = False
    """An output of an op that saved it was modified in place later in the forward: its gradient then
    passes inside the in-place op's node, not the prehook's, and a gradient that never came proves
    nothing (NOTE [ Importance estimate ])."""


def observe(key: SlotKey, source: torch.Tensor | None, flat: torch.Tensor, min_bits: int,
            group_size: int) -> Observation:
    """Measure one record on an adaptation step: its group ranges, the rounding noise of its plain groups
    (``NOTE [ Measured rounding noise ]`` in ``allocation.py``) and its producer."""
    with torch.no_grad():
        stats = kernel_ops.group_minmax(flat.detach(), group_size).double()
        mn, mx, min_pos = stats.unbind(1)
        sizes = torch.full_like(mn, group_size)
        sizes[-1] = flat.numel() - group_size * (mn.numel() - 1)
        zero = (mn == 0) & (mx > 0)
        plain_r2 = float((sizes * (mx - mn) ** 2)[~zero].sum())
        zero_r2 = float((sizes * (mx - min_pos) ** 2)[zero].sum())
        measured = _rounding_energy(flat.detach(), mn, mx, ~zero, plain_r2, group_size) if plain_r2 > 0 else ()
    shape = tuple(source.shape) if source is not None else (flat.numel(),)
    return Observation(key, shape, flat.element_size(), NoiseProfile(plain_r2, zero_r2, measured), min_bits,
                       _producer(source))


_ENERGY_SAMPLE_GROUPS = 256  # groups _rounding_energy reads: the energy's ratio to the analytic one is a
# property of the values' distribution within groups, which this many groups measure to about a per cent


def _rounding_energy(flat: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, plain: torch.Tensor,
                     plain_r2: float, group_size: int) -> tuple[float, ...]:
    """The plain groups' expected squared stochastic-rounding error at each width of ``MEASURED_BITS``
    (``NOTE [ Measured rounding noise ]``): ``sum frac * (1 - frac) * d**2`` over the values of up to
    ``_ENERGY_SAMPLE_GROUPS`` evenly spaced full plain groups, as a ratio to the analytic energy of the
    same groups, times the analytic energy of all of them (``plain_r2``, ``NoiseProfile``'s). ``()`` where
    no full group is plain."""
    full = flat.numel() // group_size
    candidates = torch.nonzero(plain[:full]).view(-1)
    if candidates.numel() == 0:
        return ()
    if candidates.numel() > _ENERGY_SAMPLE_GROUPS:
        picked = torch.linspace(0, candidates.numel() - 1, _ENERGY_SAMPLE_GROUPS, dtype=torch.float32,
                                device=candidates.device)
        candidates = candidates[picked.long()]
    lo, span = mn[candidates], (mx - mn)[candidates]
    values = flat[: full * group_size].reshape(full, group_size)[candidates].double()
    position = (values - lo[:, None]) / torch.where(span > 0, span, torch.ones_like(span))[:, None]
    sample_r2 = float((span**2).sum()) * group_size  # the sample's sum n_g * range**2
    if sample_r2 <= 0:
        return ()
    out = []
    for bits in MEASURED_BITS:  # the analytic energies' common factor 1 / (6 L**2) cancels in the ratio
        levels = (1 << bits) - 1
        frac = torch.frac(position * levels)
        sample = float(((frac - frac.square()).sum(1) * span**2).sum()) / levels**2
        out.append(sample * plain_r2 / sample_r2)
    return tuple(out)


# NOTE [ Fewest bits ]
# The variance model (NOTE [ Importance estimate ]) holds when the backward that reads a saved tensor
# is *linear* in it (contractions, ``mul``): unbiased rounding then gives an unbiased gradient. A
# nonlinear backward (GELU's ``gelu'(x)``, softmax's and tanh's products of their outputs, a norm's
# ``rstd``) turns the rounding noise into a bias of the order of ``f'' * E[e^2]`` that does not average
# out over steps and that ``V_i`` does not count (``NOTE [ Nonlinear backward ]`` in ``saved/decide.py``).
# At 1 bit a group keeps two levels, its min and max, and the bias is of the order of the values
# themselves. So a tensor saved by any op outside ``_LINEAR_SAVERS`` gets at least
# ``NONLINEAR_SAVER_MIN_BITS`` (2, what fixed 2-bit gives it) and the allocation cannot buy bytes for
# others by dropping it to 1 bit. So does a tensor with zero-exact groups (min exactly 0: ReLU outputs,
# dropped-out or causally masked attention probabilities): at 1 bit such a group has a single positive
# level, the midpoint of its positive range (``layout.py``), so every positive value is *replaced*, not
# rounded without bias (tiny probabilities become half the largest one). So does an operand of a
# *contraction of two activations* (``q @ k^T`` and ``P @ V`` of attention: matmul/bmm/einsum/sdpa whose
# every operand is computed by the forward, none a parameter, a view of one, a constant or an input; and
# a linear or convolution whose weight the forward computes, as ``weight_norm`` does: the weight's noise
# lands in the input's gradient, not a parameter's, and HuBERT's positional convolution, its weight at
# 2 bits, gave 1.7x uniform 4-bit's gradient error).
# Its backward is linear in it and its variance is estimated and calibrated like any other, yet that
# variance misses what 1 bit does there: on the character GPT-2 of ``benchmarks/bench_accuracy_parity.py``
# the calibrated allocation put most of q, k and v at 1 bit and its loss curve parted from FP32's where
# attention starts to be learned; with this floor it reaches parity at the same bytes (README, "Accuracy
# parity"; ``benchmarks/results/parity_gpt2.json``). Flooring every product of two activations, GELU's
# ``mul`` included, did not help further. A treatment's own floor (``saved/decide.py``: 8 for
# log_softmax's output) is a floor here too, so the allocation counts the bytes the record will really
# take. A budget that cannot hold every tensor at its floor (``avg_bits`` below 2) drops the floors and
# allocates from 1 bit for all (``AutoBits._solve``).
_LINEAR_SAVERS = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
    "conv1d", "conv2d", "conv3d", "mul", "__mul__", "__rmul__", "mul_", "__imul__", "multiply",
})
NONLINEAR_SAVER_MIN_BITS = 2

# Contractions that can multiply two activations; see NOTE [ Fewest bits ].
_CONTRACTIONS = frozenset({
    "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addbmm", "einsum",
    "scaled_dot_product_attention", "linear", "conv1d", "conv2d", "conv3d",
})
_LAYERS = frozenset({"linear", "conv1d", "conv2d", "conv3d"})  # (input, weight, bias, ...)


def _activation_product(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                        registry: ParameterRegistry) -> bool:
    """``name`` contracts tensors all of which the forward computed (none a parameter, a cast or view
    of one, a constant or an input); see ``NOTE [ Fewest bits ]``."""
    if name not in _CONTRACTIONS:
        return False
    if name in ("baddbmm", "addbmm"):  # the added term is not contracted
        args, kwargs = args[1:], {k: v for k, v in kwargs.items() if k != "input"}
    if name in _LAYERS:  # nor is a layer's bias; its weight is a parameter unless the forward computed it
        args, kwargs = args[:2], {k: v for k, v in kwargs.items() if k in ("input", "weight")}
    operands = _tensors(list(args) + list(kwargs.values()))
    return len(operands) >= 2 and all(t.grad_fn is not None and not is_parameter_like(t, registry)
                                      for t in operands)


def nonlinear_saver(op: str) -> bool:
    """True when one of the ops in ``op`` (``"+"``-joined, as ``SlotEstimate.op``) has a backward that is
    not linear in what it saved; see ``NOTE [ Fewest bits ]``."""
    return any(name not in _LINEAR_SAVERS for name in op.split("+") if name)


def floor_bits(ops: list[str], min_bits: int, noise: NoiseProfile, activation_product: bool = False) -> int:
    """The fewest bits a tensor saved by ``ops`` may get; see ``NOTE [ Fewest bits ]``."""
    if any(op not in _LINEAR_SAVERS for op in ops) or noise.zero_r2 > 0 or activation_product:
        return max(min_bits, NONLINEAR_SAVER_MIN_BITS)
    return min_bits


# Contractions whose other operand can be a parameter: see NOTE [ Below the width asked for ].
_PARAMETER_CONTRACTIONS = frozenset({
    "linear", "conv1d", "conv2d", "conv3d", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm",
    "baddbmm", "addbmm", "einsum",
})


# NOTE [ Below the width asked for ]
# The analytic estimate (NOTE [ Importance estimate ]) counts a tensor's noise where it first lands. For a
# tensor that a contraction with a parameter saved (a layer's input), that is the parameter's gradient,
# the quantity the gradient error is measured in; for any other (an elementwise op's operand, a norm's
# input, an attention operand) it is an activation gradient, which the backward of every layer before
# it carries on to the parameters, and the estimate undercounts it by orders of magnitude (docs/zoo.md).
# Ranked together, the allocation under an ``avg_bits`` target took bits from the latter to give them to
# the former: over the zoo of 82 architectures it made the gradient worse than uniform bits at the same
# bytes on about half of them (``benchmarks/bench_zoo_auto.py``). So until ``calibrate`` has measured the
# classes' corrections, a tensor goes below the uniform width of the target (``avg_bits`` rounded down
# to a supported width) only where every op that saved it is a contraction with a parameter
# (``lands_in_a_parameter``) and its gradient was measured; the others may get more bits, never fewer.
# A tensor whose gradient was not measured (saved outside a traced call, or an output written in place
# later, ``Observation.rewritten``) is priced at the median sensitivity, a guess: HuBERT's feature
# projection input, priced so, went to 1 bit at ``avg_bits=2`` and gave 2.4x uniform's error. With
# ``packed_bytes`` (no width) or ``error_share`` (calibrated by its own) nothing changes.
def lands_in_a_parameter(ops: list[str], activation_product: bool) -> bool:
    """Every op that saved the tensor contracts it with a parameter, so its rounding noise lands in that
    parameter's gradient; see ``NOTE [ Below the width asked for ]``."""
    return bool(ops) and not activation_product and all(op in _PARAMETER_CONTRACTIONS for op in ops)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 where it has none to read."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _same_storage(a: Any, b: torch.Tensor) -> bool:
    if not isinstance(a, torch.Tensor):
        return False
    pa = _storage(a)
    return pa != 0 and pa == _storage(b)


def _operand(a: Any, saved: torch.Tensor) -> bool:
    """``saved`` is the operand ``a``, a view of it, or a copy the op made of it (``NOTE [ Copies an op
    saves ]`` in ``lineage.py``: an autocast cast, a transposed operand folded contiguous)."""
    return _same_storage(a, saved) or copy_of(saved, a)


def _ab_contracted(a: Any, b: Any, saved: torch.Tensor) -> int | None:
    """``K`` for the saved operand of ``a @ b``: ``a``'s last dim, ``b``'s second-to-last."""
    if _operand(a, saved) and a.dim() >= 1:
        return int(a.shape[-1])
    if _operand(b, saved) and b.dim() >= 1:
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
        if _operand(op, saved) and op.dim() == len(term):
            return math.prod(int(n) for c, n in zip(term, op.shape, strict=True) if c not in out)
    return None


def _contracted(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                saved: torch.Tensor) -> float | None:
    """The size ``K`` the saved tensor is contracted over by op ``name``, or ``None`` when it is not a
    contraction operand (``rows = numel / K``); see ``NOTE [ Importance estimate ]``."""
    if name == "linear":
        x = _arg(args, kwargs, 0, "input")
        return int(x.shape[-1]) if _operand(x, saved) and x.dim() >= 1 else None
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
        if _operand(x, saved) and isinstance(w, torch.Tensor) and w.dim() >= 2:
            return int(w.shape[1]) * math.prod(int(k) for k in w.shape[2:])
        return None
    if name == "einsum":
        return _einsum_contracted(args, saved)
    if name == "scaled_dot_product_attention":
        # q, k and v themselves: what the call saves under the attention rule (``NOTE [ Attention recomputed
        # from its stored inputs ]`` in ``saved/recomputed_attention.py``), as the fused kernels do, or a chunk of
        # one (``NOTE [ Chunks stored apart ]``), whose noise meets its chunk's share of ``G``: the rows of the
        # whole operand, ``K`` scaled by the chunk's share of it.
        q, k, v = (_arg(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        if _same_storage(q, saved) or _same_storage(k, saved):
            t = q if _same_storage(q, saved) else k
            return t.shape[-1] * saved.numel() / max(1, t.numel())
        if _same_storage(v, saved) and v.dim() >= 2:
            return v.shape[-2] * saved.numel() / max(1, v.numel())
    return None


# Normalisations whose input reaches their backward scaled by rstd; see NOTE [ Importance estimate ].
_NORMS = frozenset({"layer_norm", "rms_norm", "batch_norm"})


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


# NOTE [ Importance estimate ]
# Quantizing saved tensor ``x_i`` adds zero-mean noise ``e_i`` (stochastic rounding is unbiased) to what
# backward reads, so the gradients get an extra variance ``V_i(b) ~= s_i * E||e_i||^2``:
#   1. ``E||e_i||^2`` at any bit-width follows from the group ranges (``NoiseProfile.energy``); the
#      ranges come from ``group_minmax`` over the tensor on the adaptation step (``observe``, one read);
#   2. the noise reaches the gradients only through the backward of the op that *saved* ``x_i``, and
#      that backward scales it by the op's *output* gradient ``G`` (ActNN weighs a layer by
#      ``||dL/dy||^2`` of its output for the same reason). So ``s_i`` is read from ``G``, not from
#      ``dL/dx_i``: on an adaptation step a ``TorchFunctionMode`` (``_SaverMode``, active only during
#      that step's forward) notes which records each torch function call creates (or saves again, see
#      ``NOTE [ One record per storage span ]`` in ``saved/hooks.py``), and a prehook on the call's
#      output ``grad_fn`` adds ``||G||^2`` times the op's fan-out factor ``c`` to those records' ``s_i``:
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
#      gets the median of the others (``AutoBits._finalize``), and so does one whose op's output the
#      forward later writes into in place (``Observation.rewritten``: HuBERT writes its masked time
#      steps into the feature projection's output, whose gradient then reaches it inside the in-place
#      op's node, past the prehook, and a zero would put its input at 1 bit).
# The error of a contraction lands directly in a parameter's gradient; that of a fan-out-one op lands
# in an activation gradient and reaches the parameters through the backward of the layers before it;
# the estimate counts it at that first landing, not through the rest of the network (doing so exactly
# would need a backward per tensor). ``tests/auto/test_importance.py`` compares ``V_i`` with the
# variance measured over repeated quantized backward passes on a small MLP.
# The estimate costs no extra forward or backward pass (GACT runs three per tensor): on an adaptation
# step, one min/max read per saved tensor, one Python call per torch function of the forward and one
# squared-norm per traced op output in backward, amortised over ``adapt_interval`` steps
# (``benchmarks/bench_importance_overhead.py`` measures it). ``V_i`` is an order-of-magnitude estimate
# of the true variance; the allocation only needs it to rank tensors. Across op kinds it is not even
# that (noise landing in an activation gradient is undercounted by orders of magnitude):
# ``compress.calibrate`` measures a correction per class of slots, see ``NOTE [ Calibration ]`` in
# ``calibration.py``.
def _fan_out(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], saved: torch.Tensor,
             numel_out: int) -> float:
    """The factor ``c`` with ``s = c * ||G||^2``; see ``NOTE [ Importance estimate ]``."""
    k = _contracted(name, args, kwargs, saved)
    if k is not None:
        return k / max(1, saved.numel())
    n, m = max(1, saved.numel()), max(1, numel_out)
    c = 1.0 / m if m >= n else m / n**2  # a reduction shares each output's G among n/m inputs
    if name in _NORMS and _operand(_arg(args, kwargs, 0, "input"), saved):
        c *= _mean_rstd_sq(name, args, kwargs)
    return c


def _attribute(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any,
               saved: list[tuple[Observation, torch.Tensor]], tracer: SaveTracer) -> None:
    """Hook the output gradient of one traced call onto the records it saved."""
    name = getattr(func, "__name__", None) or str(func)
    outs = _tensors(out)
    numel_out = sum(t.numel() for t in outs)
    contribs = []
    activation_product = _activation_product(name, args, kwargs, tracer.registry)
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
        if tracer.ignores_gradients:  # calibrate()'s extra backward passes are not the step's gradient
            return
        sq = math.fsum(squared_norm(g) for g in grad_outputs if g is not None)
        for obs, c in contribs:
            obs.grad_sq = sq if obs.grad_sq is None else obs.grad_sq + sq
            obs.sensitivity += c * sq

    for node in nodes:
        node.register_prehook(on_grad)
    for obs, _ in contribs:
        obs.hooked = True
    for t in outs:
        tracer.watch(t, [obs for obs, _ in contribs])


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


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                               "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                               "__ilshift__", "__irshift__"})


def _writes_in_place(func: Any) -> bool:
    """``func`` modifies its first argument in place (``add_``, ``masked_fill_``, ``x[i] = v``, ``+=``)."""
    name = getattr(func, "__name__", "")
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


class _SaverMode(EagerMode):
    """One thread's tracer: attributes each record its forward saves to the call that saved it."""

    def __init__(self, tracer: SaveTracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.saved: list[tuple[Observation, torch.Tensor]] = []
        """Records saved (or saved again) inside the traced call in progress, innermost last."""

    def _handle(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        if args and not torch.compiler.is_compiling() and _writes_in_place(func):
            self.tracer.written(args[0])  # eager only: compiled graphs store exact under bits="auto"
        saved = self.saved
        start = len(saved)
        out = func(*args, **kwargs)  # the mode is off inside: nested calls belong to this one
        if len(saved) > start:
            mine = saved[start:]
            del saved[start:]
            _attribute(func, args, kwargs, out, mine, self.tracer)
        return out


# NOTE [ One tracer per thread ]
# Torch function modes live on a per-thread stack, and so do saved-tensor hooks: two threads that run
# their forwards under one ``compress`` context each push the hooks, and each must push (and pop) its
# own mode. The tracer therefore keeps its active mode, and the records saved inside the call that
# mode is tracing, in thread-local storage; one thread's ``stop`` never pops another's mode. The
# observations themselves are shared: both threads' records feed one estimate.
class SaveTracer:
    """Traces the forward of adaptation steps, per thread; see ``NOTE [ One tracer per thread ]``."""

    def __init__(self, registry: ParameterRegistry) -> None:
        self.registry = registry
        """The model's parameter and buffer storages: operands that are not activations."""
        self._local = threading.local()
        self._ignoring = 0

    @property
    def active(self) -> bool:
        """True while this thread's forward is traced."""
        return getattr(self._local, "mode", None) is not None

    @property
    def ignores_gradients(self) -> bool:
        """True inside ``ignoring_gradients()``: output gradients do not count."""
        return self._ignoring > 0

    def start(self) -> None:
        """Trace this thread's forward from now on (restarting a trace left running)."""
        self.stop()
        mode = _SaverMode(self)
        mode.__enter__()
        self._local.mode = mode
        self._local.watched = {}

    def stop(self) -> None:
        """Stop tracing this thread's forward."""
        mode = getattr(self._local, "mode", None)
        self._local.mode = None
        self._local.watched = {}
        if mode is not None:
            mode.__exit__(None, None, None)

    def watch(self, out: torch.Tensor, observations: list[Observation]) -> None:
        """``out`` is an output of the call that saved ``observations``: an in-place write into its
        storage later in the forward marks them ``rewritten`` (``written``)."""
        storage = _storage(out)
        if storage:
            self._local.watched.setdefault(storage, []).append((weakref.ref(out), observations))

    def written(self, target: Any) -> None:
        """The forward modifies ``target`` in place: mark the records saved by a call whose output shares
        its storage, if that output is still alive (its storage was not freed and reused)."""
        watched = getattr(self._local, "watched", None)
        if not watched or not isinstance(target, torch.Tensor):
            return
        for ref, observations in watched.get(_storage(target), ()):  # 0, no storage, is never watched
            if ref() is not None:
                for obs in observations:
                    obs.rewritten = True

    def note(self, obs: Observation, source: torch.Tensor) -> None:
        """``source`` was saved as ``obs``'s record inside the call this thread is tracing, if any."""
        mode = getattr(self._local, "mode", None)
        if mode is not None:
            mode.saved.append((obs, source))

    @contextlib.contextmanager
    def ignoring_gradients(self) -> Iterator[None]:
        """Backward passes run inside do not add to the estimate (``compress.calibrate``'s extra ones)."""
        self._ignoring += 1
        try:
            yield
        finally:
            self._ignoring -= 1
