"""What to do with a saved tensor, decided from its metadata only (never from its values)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import torch

from ..config import CompressionConfig
from ..layout import QUANTIZABLE_DTYPES, STORED_AS_FLOAT32
from ..lineage import signed
from ..params import ParameterRegistry, is_parameter_like
from .op_rules import OpMatch, computed, keeps, match_saved
from .records import (
    NARROWABLE_DTYPES,
    ClipMask,
    Encoding,
    Normalized,
    PoolWindows,
    Probabilities,
    is_dense,
    is_expanded,
    stored_numel,
)
from .small_tensors import small_tensor_bits, worth_batching


class Treatment(enum.Enum):
    QUANTIZE = "quantize"
    QUANTIZE_IF_LOSSLESS = "quantize_if_lossless"
    PACK_BOOL = "pack_bool"
    PACK_INTEGER = "pack_integer"
    BATCH = "batch"
    KEEP = "keep"


@dataclass(frozen=True)
class Decision:
    treatment: Treatment
    reason: str
    """Why a tensor is kept: parameter, layout, empty, tiny, integer, bool, dtype, exact, constant, checkpoint (a
    ``torch.utils.checkpoint`` region's input, ``hooks.py``)."""
    min_bits: int = 1
    """The fewest bits this tensor may be quantized to (see NOTE [ Nonlinear backward ])."""
    encoding: Encoding | None = None
    """How an op rule stores it instead of plain quantization (``NOTE [ Op rules ]`` in ``op_rules.py``)."""
    rule: str = ""
    """The op rule that applied, if any."""


# NOTE [ Constants are stored losslessly or kept ]
# A float tensor outside the differentiable graph (no grad_fn, no requires_grad) is never quantized
# lossily. Such tensors are the auxiliary outputs ops save for their own backward (LayerNorm's rstd,
# BatchNorm's inverse std, SDPA's logsumexp), frozen weights and their autocast casts (LoRA's base
# layers), the batch itself, and dropout masks on CPU (float tensors of 0 and 1/(1-p)). Errors in the
# first kinds enter backward multiplicatively or exponentially (a 1-bit logsumexp wrecks attention's
# gradient). Their group min/max decide: when every group is constant, or zero plus one positive
# value (a dropout mask), the 1-bit layout stores it exactly (see layout.py) and it is packed;
# otherwise it is kept as it is.


# NOTE [ Nonlinear backward ]
# Stochastic rounding makes a saved tensor unbiased, and a backward that is linear in it (matmul,
# convolution, ReLU's mask) then gives an unbiased gradient. log_softmax's backward computes
# ``exp(y)`` of the output it saves: rounding noise turns into bias there, and at 2 bits a
# log-probability range of ~30 nats has steps of ~10 nats, of which ``exp`` is no estimate at all;
# at 8 bits the step is ~0.12 nats. softmax (``y * (g - sum(g * y))``) and tanh (``1 - y**2``) are
# quadratic in bounded outputs: flooring them too barely moved the loss while costing attention
# probabilities and MLP activations 4x their bytes, so they stay with the configured bits. A logsumexp's
# (or logcumsumexp's) input is exponentiated the same way, less the result: the ``exponentiated`` op rule floors
# it too (at 2 bits its gradient's cosine was 0.59, logcumsumexp's 0.34). The measurements are in docs/saved.md
# ("Nonlinear backward").
NONLINEAR_MIN_BITS = 8
_NONLINEAR_OUTPUT_NODES = frozenset({"LogSoftmaxBackward0"})
_SOFTMAX_OUTPUT_NODES = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})


# Decisions without a per-tensor argument, made once (``Decision`` is frozen): ``decide`` runs for every save.
_KEEP = {reason: Decision(Treatment.KEEP, reason)
         for reason in ("layout", "parameter", "empty", "tiny", "bool", "integer", "dtype", "exact")}
_CONSTANT = Decision(Treatment.QUANTIZE_IF_LOSSLESS, "constant")
_PACK_BOOL = Decision(Treatment.PACK_BOOL, "")
_PACK_INTEGER = Decision(Treatment.PACK_INTEGER, "")
_QUANTIZE = Decision(Treatment.QUANTIZE, "")
_BATCH = Decision(Treatment.BATCH, "")


def decide(t: torch.Tensor, config: CompressionConfig, registry: ParameterRegistry,
           call: OpMatch | None = None) -> Decision:
    """The treatment of one saved tensor; see ``NOTE [ Recognising parameters ]``. ``call`` is the
    rule-matched op call in progress (``op_rules.OpTracer.current()``), if any."""
    if not has_storage(t):
        return _KEEP["layout"]
    if is_parameter_like(t, registry):
        return _KEEP["parameter"]
    if t.numel() == 0:
        return _KEEP["empty"]
    if t.numel() < config.min_numel or stored_numel(t) < config.min_numel:  # an expanded view: its real size
        return _small(t, config, call)
    if t.dtype == torch.bool:
        return _PACK_BOOL if config.pack_bool else _KEEP["bool"]
    if not (t.is_floating_point() or t.is_complex()):
        if not config.pack_integers or t.dtype not in NARROWABLE_DTYPES:
            return _KEEP["integer"]
        windows = _windows_of_indices(t, match_saved(call, t))
        return _PACK_INTEGER if windows is None else Decision(Treatment.PACK_INTEGER, "", encoding=windows,
                                                               rule="pool_indices")
    if t.dtype not in QUANTIZABLE_DTYPES and (t.dtype not in STORED_AS_FLOAT32 or _beneath_float32(t)):
        return _KEEP["dtype"]
    if config.bits is None:
        return _KEEP["exact"]
    if t.grad_fn is None and not computed(call, t):
        return _CONSTANT
    if type(t.grad_fn).__name__ in _NONLINEAR_OUTPUT_NODES:
        return _softmax_output(t, log=True)
    if keeps(call, t):
        return Decision(Treatment.KEEP, "op_rule", rule=call.rule.name if call is not None else "")
    match = match_saved(call, t)
    if match is not None:
        return _by_rule(t, match, config)
    if type(t.grad_fn).__name__ in _SOFTMAX_OUTPUT_NODES:
        return _softmax_output(t)
    return _QUANTIZE


FLOAT32_SMALLEST_RANGE = 1e-30
"""A float64 tensor whose largest magnitude is below this is kept: its groups' ranges over 2**bits would not be
normal numbers in the records' float32 and bfloat16 (``NOTE [ Double precision stored through float32 ]`` in
hooks.py)."""


def _beneath_float32(t: torch.Tensor) -> bool:
    """Whether float64 ``t`` is too small in magnitude to be stored through float32 (one read of it, no copy; a NaN
    or an infinity answers no: the record's finiteness check keeps those)."""
    low, high = (float(v) for v in torch.aminmax(t.detach()))
    top = max(-low, high)
    return 0.0 < top < FLOAT32_SMALLEST_RANGE


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has values in a storage of its own to account and pack: not sparse, nested or meta."""
    return t.layout == torch.strided and not t.is_nested and t.device.type != "meta"


_LOG_SOFTMAX_OUTPUT = Decision(Treatment.QUANTIZE, "", min_bits=NONLINEAR_MIN_BITS)


def _softmax_output(t: torch.Tensor, log: bool = False) -> Decision:
    """A softmax's (``log``: a log_softmax's, at least ``NONLINEAR_MIN_BITS``) saved output, found by its node
    inside any function (eager attention's, or SDPA's math path without the attention rule), restored with rows
    that sum to 1 (``NOTE [ Probabilities keep their sums ]`` in ``records.py``); a tensor not contiguous is
    quantized as it is."""
    plain = _LOG_SOFTMAX_OUTPUT if log else _QUANTIZE
    dim = signed(t.grad_fn._saved_dim) % max(1, t.dim())  # type: ignore[union-attr]
    if not t.is_contiguous() or t.dim() == 0 or t.shape[dim] < 2:
        return plain
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim + 1:])
    return replace(plain, encoding=Probabilities((outer, t.shape[dim], inner), log=log),
                   rule="log_softmax" if log else "softmax")


def _small(t: torch.Tensor, config: CompressionConfig, call: OpMatch | None) -> Decision:
    """A tensor under ``min_numel`` values: staged with others into one 8-bit record where no op rule treats it
    (float32, at fixed bits or under an ``avg_bits`` target), else kept (``NOTE [ Small tensors packed
    together ]`` in ``small_tensors.py``)."""
    bits = small_tensor_bits(config)
    if (bits is not None and t.dtype == torch.float32 and t.grad_fn is not None
            and type(t.grad_fn).__name__ not in _NONLINEAR_OUTPUT_NODES and not is_expanded(t)
            and worth_batching(t.numel(), t.element_size(), bits, config.group_size)
            and not keeps(call, t) and match_saved(call, t) is None):
        return _BATCH
    return _KEEP["tiny"]


def _windows_of_indices(t: torch.Tensor, match: OpMatch | None) -> PoolWindows | None:
    """The window encoding of a max pool's saved indices ``t`` (``NOTE [ Max-pool indices as window positions ]``
    in ``records.py``), with their shape and the order of their dims in memory (channels_last: permuted)."""
    windows = match.encoding if match is not None else None
    if not isinstance(windows, PoolWindows) or t.dim() <= len(windows.kernel) or not is_dense(t):
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    if not t.permute(order).is_contiguous():
        return None
    return replace(windows, shape=tuple(t.shape), order=order)


# NOTE [ Derivative encoding under bits="auto" ]
# A GELU's, SiLU's, Hardswish's or Mish's input is stored as ``f'(x)`` under bits="auto" too: out of place the
# call saves ``f'(x)`` itself (``NOTE [ Activations that save their derivative ]`` in
# ``activation_derivative.py``), a tensor as any other to auto; in place its input's copy is stored with the
# ``Derivative`` encoding (``NOTE [ Activations stored as their derivative ]`` in ``records.py``), and
# bits="auto" sees what the record stores: an
# adaptation step observes the group ranges of ``f'(x)``, not of ``x`` (``BitPolicy.assign``'s
# ``stored_as``), and a calibration pass adds its noise to ``f'(x)`` and restores an input from it
# (``CalibrationPass``), so the estimate and its calibration are of the quantity that is rounded.
# Before, auto stored these inputs as values, and a model whose gradient runs through a stack of GELUs
# without a residual path (data2vec-audio's positional convolution) got 4.6x fixed 4-bit's gradient
# error at the same bytes.
def _by_rule(t: torch.Tensor, match: OpMatch, config: CompressionConfig) -> Decision:
    """A tensor an op rule treats. ``ClipMask`` and ``Derivative`` are elementwise; a ``Normalized``
    encoding, built for ``t``'s logical order, is put in its memory order where ``t`` is packed in it
    (``NOTE [ Normalised records in memory order ]`` in ``records.py``)."""
    encoding = match.encoding
    if encoding is None:
        return Decision(Treatment.QUANTIZE, "", min_bits=match.rule.min_bits, rule=match.rule.name)
    if isinstance(encoding, ClipMask):  # exact at any bits: packed like a bool mask, no bits to allocate
        return Decision(Treatment.PACK_BOOL, "", encoding=encoding, rule=match.rule.name)
    if isinstance(encoding, Normalized) and not t.is_contiguous():
        # an expanded view is packed as its compact form, whose shape the encoding was not built for;
        # any other view that is not dense is packed from its contents, in logical order
        encoding = None if is_expanded(t) else encoding.in_memory_order(t) if is_dense(t) else encoding
        if encoding is None:
            return Decision(Treatment.KEEP, "op_rule")
    return Decision(Treatment.QUANTIZE, "", encoding=encoding, rule=match.rule.name)
