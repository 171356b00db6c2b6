"""The op rules: how a tensor is stored when the op that saves it needs more than plain quantization.

``RULES`` is the one table, each rule with its reason. ``OpTracer`` notes, per thread, the rule-matched
torch function call in progress while a ``compress`` context is active; ``decide`` (``decide.py``)
consults ``match_saved`` once per saved tensor.
"""

from __future__ import annotations

import functools
import math
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..callbacks import eagerly, never_a_frame
from ..calls import argument as _arg
from ..calls import reduced_dims
from ..lineage import CAST_AND_VIEW_NODES, copy_of, reaches
from .activation_derivative import saving_derivative
from .attention_precision import AttentionPrecision, MaskStorage
from .cross_entropy import cross_entropy_saving_logits, saves_logits
from .extremum import extremum_saving_positions, pairwise_extremum_saving_comparisons, reads_positions
from .jumps import saving_sides
from .linear_cross_entropy import LinearOutputs, cross_entropy_over_linear
from .nesting import saves_reach_daftrain
from .recomputed_attention import attention_recomputed, recomputes
from .records import ClipMask, Derivative, Encoding, Normalized, PoolWindows, stored_numel

__all__ = ["LOGITS_MIN_BITS", "RULES", "AmplifiedRoundingWarning", "ExactSavings", "OpMatch", "OpRule", "OpTracer",
           "computed", "keeps", "match_saved", "may_have_wide_head"]

ATTENTION_MIN_BITS = 8
EXPONENTIATED_MIN_BITS = 8
"""A logsumexp's input, which its backward exponentiates, as ``decide.NONLINEAR_MIN_BITS`` floors a log_softmax's
output."""
LINEAR_ALGEBRA = (
    *(getattr(torch.linalg, name) for name in (
        "eigh", "eigvalsh", "eig", "eigvals", "svd", "svdvals", "cholesky", "cholesky_ex", "inv", "inv_ex", "solve",
        "solve_ex", "solve_triangular", "lstsq", "pinv", "qr", "det", "slogdet", "matrix_norm", "cond", "lu",
        "lu_factor", "lu_factor_ex", "lu_solve", "ldl_factor", "ldl_factor_ex", "ldl_solve", "householder_product",
        "tensorinv", "tensorsolve")),
    *(getattr(owner, name) for owner in (torch, torch.Tensor) for name in (
        "cholesky_solve", "cholesky_inverse", "logdet", "det", "slogdet", "inverse", "pinverse", "svd",
        "triangular_solve", "lu_solve", "qr", "cholesky", "orgqr", "ormqr")))
"""Decompositions, inverses and solves: their backward inverts what they save, or divides by gaps between its
eigenvalues or singular values (``singular_backward``)."""
COSINE_MIN_BITS = 8
WEIGHT_MIN_BITS = 8
LOGITS_MIN_BITS = 8


class AmplifiedRoundingWarning(UserWarning):
    """A value an op inverts or divides by in backward is a product of two tensors ``compress`` stored rounded (a
    Gram or covariance matrix before a Cholesky factor, an eigendecomposition or a log-determinant): the gradient
    multiplies their rounding error by up to that matrix's condition number."""


@dataclass(frozen=True)
class OpRule:
    """One class of ops whose saved tensors need a treatment of their own."""

    name: str
    functions: tuple[Any, ...]
    reason: str
    min_bits: int = 1
    """Floor on the bits of the tensors the rule matches (with no ``encoding``)."""


# NOTE [ Op rules ]
# Plain quantization adds unbiased noise of the order of a group's range / 2**bits to every saved
# value; that is harmless where backward is linear in the value with bounded factors. Eight classes of
# ops break that (measured over the zoo, ``docs/zoo.md``), and two save more than their backward needs:
#   1. normalisations (``F.normalize``'s unit vectors too) re-normalise their saved input with their
#      exact statistics: the error of a row, channel or vector of small spread is multiplied by its rstd
#      (``Normalized`` encoding); a constant row
#      (a class token of zeros under LayerNorm with eps 1e-12: rstd 1e6) is restored exactly;
#   2. attention (SDPA) saves, besides q, k and v, what its forward computed from them (the output and the
#      logsumexp, or the probabilities), and its backward relies on identities between them that rounding
#      each one breaks: the call runs as a function that saves q, k and v only and recomputes the rest
#      from them in backward (``NOTE [ Attention recomputed from its stored inputs ]`` in
#      ``recomputed_attention.py``). An error ``e`` in a logit is a factor ``exp(e)`` on its probability, so
#      q and k get at least ``ATTENTION_MIN_BITS``; where even 8 bits would err the logits by more than
#      ``LOGIT_ERROR_LIMIT``, q, k and v are kept exact (``NOTE [ Attention logits that need more than 8
#      bits ]`` in ``attention_precision.py``);
#   3. clips that save their input (hardtanh, relu6, clamp, threshold, hardsigmoid) read it only through
#      the mask of values inside their bounds, and a leaky ReLU reads its input (or, in place, its output)
#      only through its sign, an absolute value through its sign and its zeros; a rounded value near a bound
#      flips it (``ClipMask`` encoding: the mask, exact, at 1 bit per value; 2 with the zeros);
#   4. an elementwise maximum or minimum against a 0-d tensor reads its input only through the
#      comparison with it, like a clip, ties included (``ClipMask`` with ties); of two tensors, the call runs
#      as a function that saves their comparisons (``NOTE [ Elementwise extrema save their comparisons ]`` in
#      ``extremum.py``);
#   5. smooth activations (GELU, SiLU, Mish) and Hardswish read their saved input only through their
#      derivative f'(x), which is nonlinear: rounding x makes f'(x) noisier (by |f''| up to 0.8; Hardswish's
#      jumps by 0.5 at -3 and 3) and biased, and through a stack of such layers without a residual path
#      the errors compound: f'(x) itself is stored, quantized (out of place saved by the call, run as a
#      function, ``NOTE [ Activations that save their derivative ]`` in ``activation_derivative.py``; in place,
#      where they save a copy of their input, that copy as the ``Derivative`` encoding, ``NOTE [ Activations
#      stored as their derivative ]``);
#   6. a layer whose weight the forward computes (weight norm, spectral norm, a parametrization, an
#      equalized-learning-rate scale) saves that weight: one tensor shared by every sample, so its
#      rounding error is one draw applied to the whole batch. An activation's error averages over the
#      samples summed into a weight gradient; the weight's enters every sample's input gradient alike
#      and does not, so its share of the gradient error grows with the batch while its bytes do not
#      (at least ``WEIGHT_MIN_BITS``). Layers save it transposed (under autocast, cast): views match;
#   7. a division by a statistic of the dividend's rows (``a / s``, ``s`` of size 1 along the dims it
#      reduced: a norm, a standard deviation, a sum; a LayerNorm, an L2 normalisation or a softmax
#      written out) is a normalisation written out: ``-g a / s**2`` multiplies the error of ``a`` by
#      1/s, and a rounded ``s``, shared by a row whose ``s`` is small next to its group's range, is off
#      by a large factor; the vector norm that computes such an ``s`` reads its input as ``x / norm``
#      in backward, the same factor (``Normalized`` encoding of ``a`` or ``x`` over the reduced dims,
#      ``s`` and the norm exact);
#   8. cross-entropy over class indices saves its log-probabilities and holds three tensors of the logits'
#      size in backward: the call runs as a function that saves the logits instead (exponentiated in
#      backward: at least ``LOGITS_MIN_BITS``) and holds two (``NOTE [ Cross-entropy that saves its
#      logits ]`` in ``cross_entropy.py``); over the output of a wide linear layer (a language model's
#      head) as a function of that layer's input, weight and bias, which holds none (``NOTE [ Cross-entropy
#      over a wide linear layer ]`` in ``linear_cross_entropy.py``);
#   9. a max pool saves int64 indices into each input plane, one per output value, each inside its output
#      position's window: stored as the position in the window, one byte (``PoolWindows``, ``NOTE [ Max-pool
#      indices as window positions ]`` in ``records.py``);
#  10. a product of unit vectors (``F.normalize``'s, or ``x / x.norm(...)``) is a cosine similarity, which
#      models scale by a learned temperature before a softmax (SwinV2's attention, CLIP's and SigLIP's
#      logits: up to 100x, where a dot-product attention scales by 1/sqrt(d)): the scores' gradient enters
#      each operand's input gradient multiplied by it, with the rounding error of the other operand, and
#      that path then dominates the input gradient of every layer below it (the residual one is not
#      scaled): both operands at least ``COSINE_MIN_BITS``;
#  11. ops whose backward divides by a value they save, inverts it, or is singular in it (``NOTE [ Singular
#      backward ]``): kept exact;
#  12. a maximum or minimum over dims (or of a whole tensor) reads its input only through which values equal its
#      result; rounded, none may, and the gradient is NaN (or zero): the call runs as a function that saves those
#      positions; a scatter or segment reduction by a maximum or minimum, and an infinity norm, keep what they
#      save (``NOTE [ Extrema save their positions ]`` in ``extremum.py``);
#  13. a logsumexp's backward exponentiates its saved input less its result: at least 8 bits, as a
#      log_softmax's output (``NOTE [ Nonlinear backward ]`` in decide.py).
_BY_INDEX = (torch.scatter_reduce, torch.Tensor.scatter_reduce, torch.Tensor.scatter_reduce_, torch.index_reduce,
             torch.Tensor.index_reduce, torch.Tensor.index_reduce_, torch.segment_reduce)
"""Reductions through an index or by segments, whose ``reduce`` argument names how."""
_SQUARING = (torch.square, torch.Tensor.square, torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.multiply,
             torch.Tensor.multiply)
"""Calls that square a tensor, with ``_POWERS`` (``NOTE [ Saves held for a singular backward ]`` in singular.py)."""
_EXTREMA = frozenset({"amax", "amin", "max", "min"})
_PRODUCT = frozenset({"prod"})
_CLAMP_MIN = (torch.clamp_min, torch.Tensor.clamp_min, torch.Tensor.clamp_min_)
_CLAMP_MAX = (torch.clamp_max, torch.Tensor.clamp_max, torch.Tensor.clamp_max_)
_NORMS = (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm)
_MARGIN_LOSSES = (F.margin_ranking_loss, F.triplet_margin_loss, F.triplet_margin_with_distance_loss,
                  F.cosine_embedding_loss, F.hinge_embedding_loss, F.multi_margin_loss, F.multilabel_margin_loss)
_JUMPS = (F.prelu, F.selu, F.elu)
RULES: tuple[OpRule, ...] = (
    OpRule("normalization", (F.layer_norm, F.batch_norm, F.instance_norm, F.group_norm, F.rms_norm, F.normalize),
           "backward re-normalises the input with the exact rstd (or, for F.normalize, its exact norm), "
           "multiplying the rounding error of a row of small spread by up to 1/spread: store x_hat = "
           "(x - mean) / std quantized, mean/std exact"),
    OpRule("decomposed_rms_norm",
           (torch.Tensor.pow, torch.pow, torch.Tensor.__pow__, torch.Tensor.__mul__, torch.Tensor.mul, torch.mul,
            torch.rsqrt, torch.Tensor.rsqrt),
           "x.pow(2).mean(-1) and x * rsqrt(var): an RMSNorm written out (T5LayerNorm, LlamaRMSNorm, QK-norms) "
           "multiplies x's rounding error by rsqrt(var) like a fused norm: x stored normalised per row; "
           "rsqrt(var) (one value per row, rows of very different scale in one group) kept exact"),
    OpRule("attention_qk", (F.scaled_dot_product_attention,),
           "the backward reads the output and logsumexp (or the probabilities) the forward computed from q, k and "
           "v, through identities that separately rounded tensors break: the call saves q, k and v only and "
           "recomputes the rest from them in backward, the exact gradient of attention at the rounded inputs; a "
           "logit error e is a factor exp(e) on a probability, so q and k get at least 8 bits, and where 8 bits "
           "would err the logits by more than 0.05 nats (logits of large spread, peaked probabilities) q, k and v "
           "are kept exact",
           min_bits=ATTENTION_MIN_BITS),
    OpRule("clip_mask",
           (F.hardtanh, F.relu6, torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip,
            torch.Tensor.clamp_, torch.Tensor.clip_, F.threshold, F.hardtanh_, F.leaky_relu, F.leaky_relu_,
            F.hardsigmoid, F.hardshrink, torch.Tensor.hardshrink, F.softshrink, torch.abs, torch.Tensor.abs,
            torch.Tensor.__abs__, torch.absolute, torch.Tensor.absolute, torch.Tensor.abs_, F.l1_loss,
            *_CLAMP_MIN, *_CLAMP_MAX, *_NORMS, *_MARGIN_LOSSES, *_JUMPS),
           "the backward reads the saved tensor only as the mask of values inside the bounds (a shrink's outside "
           "them; a leaky ReLU's sign picks 1 or its slope; an absolute value's sign, 0 at 0, picks 1, -1 or 0, "
           "an L1 loss's of its input less its target, an L1 norm's of its input); rounding flips it near a "
           "bound: the mask is stored exactly, 1 bit per value (2 with the zeros). A margin loss clamps a value "
           "it makes inside the call next to others of its size (a ranking's difference, a triplet's distances, "
           "which it divides by, a cosine embedding loss's cosines): what it saves is kept exact. PReLU's and "
           "SELU's (ELU's) derivative jumps at 0 and reads the values too: the call runs as a function that saves "
           "the side of 0 exactly beside them"),
    OpRule("comparison",
           (torch.max, torch.min, torch.maximum, torch.minimum, torch.Tensor.max, torch.Tensor.min,
            torch.Tensor.maximum, torch.Tensor.minimum),
           "an elementwise maximum or minimum against a 0-d tensor reads its input only through the comparison "
           "with it (ties split the gradient): the comparison and the ties are stored exactly, 2 bits per value; "
           "quantized, an attention mask's finfo.min floor gives the input a group range of ~1e38. Of two tensors "
           "(PPO's clipped value loss), rounded apart, ties split and close values swap sides: the call runs as "
           "a function that saves the two comparisons, 1 bit per value each"),
    OpRule("extremum", (torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin, torch.max, torch.Tensor.max,
                        torch.min, torch.Tensor.min, *_BY_INDEX, torch.linalg.vector_norm, torch.linalg.norm,
                        torch.linalg.matrix_norm, torch.norm, torch.Tensor.norm),
           "amax / amin over dims, a whole tensor's max / min, a scatter or segment reduction by amax / amin and "
           "an infinity norm send the gradient to the values equal to the result; a rounded row's maximum "
           "equals none of its rounded values where a quantization group spans rows (a count of 0: a NaN "
           "gradient), a whole tensor's rebuilt extreme need not equal it to the last bit (a zero gradient): "
           "the reductions run as a function that saves those positions, exact, 1 bit per value; those through "
           "an index or a norm keep what they save exact"),
    OpRule("activation_derivative", (F.gelu, F.silu, F.hardswish, F.mish),
           "the backward reads the input only as f'(x), nonlinear: a rounded x gives a biased, noisier f'(x) "
           "(Hardswish's jumps at -3 and 3 flip like a clip's mask), compounding through stacked layers without "
           "a residual path: f'(x) (bounded) is stored quantized, unbiased: out of place saved by the call itself, "
           "the gradient multiplied into its decode; in place, the copy autograd saves of the input stored as "
           "f'(x) and restored as an x' with f'(x') = that value"),
    OpRule("statistic_of_rows",
           (torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide, torch.Tensor.true_divide,
            torch.norm, torch.Tensor.norm, torch.linalg.vector_norm),
           "a / s with s a statistic of a's rows (size 1 along the dims it reduced), and the vector norm of x "
           "along some dims: backward multiplies the rounding error of a (x) by 1/s (1/norm), and a rounded s of "
           "a small row is off by a large factor: a (x) stored normalised over the reduced dims, s (norm) exact"),
    OpRule("computed_weight",
           (F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
            F.conv_transpose3d),
           "a weight the forward computes (weight or spectral norm, a parametrization, a scaled weight) is one "
           "tensor shared by every sample: its rounding error does not average over the batch, it enters the "
           "gradient of every sample's input, and its size does not grow with the batch: at least 8 bits",
           min_bits=WEIGHT_MIN_BITS),
    OpRule("exponentiated", (torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp, torch.logcumsumexp,
                             torch.Tensor.logcumsumexp),
           "the backward exponentiates the saved input less the result (a row's softmax): a rounding step of s "
           "nats scales a probability by up to exp(s), no estimate of it at 2 bits (``NOTE [ Nonlinear backward ]`` "
           "in decide.py): both at least 8 bits", min_bits=EXPONENTIATED_MIN_BITS),
    OpRule("cosine_product",
           (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.einsum),
           "a product of unit vectors is a cosine similarity that models scale by a learned temperature (up to "
           "100x) before a softmax: the scores' gradient enters both operands' input gradients multiplied by it, "
           "carrying the other operand's rounding error into every layer below: both at least 8 bits",
           min_bits=COSINE_MIN_BITS),
    OpRule("pool_indices", (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.max_pool1d_with_indices,
                            F.max_pool2d_with_indices, F.max_pool3d_with_indices),
           "a max pool's indices are flat positions in each input plane, but each lies in its output position's "
           "window: stored as its position there (one byte, not eight), restored exactly from the window's start"),
    OpRule("cross_entropy", (F.cross_entropy,),
           "log_softmax then nll_loss saves the log-probabilities and its backward holds three tensors of the "
           "logits' size; run as one function that saves the logits (exponentiated in backward: at least 8 "
           "bits) and writes the gradient into one tensor with PyTorch's own backward ops, chunk by chunk: two; "
           "over a wide linear layer's output, as a function of the layer's input (exact), weight and bias that "
           "recomputes the logits tile by tile in backward: none",
           min_bits=LOGITS_MIN_BITS),
    OpRule("singular_backward",
           (torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide, torch.Tensor.true_divide,
            torch.Tensor.div_, torch.Tensor.__itruediv__, torch.Tensor.__rtruediv__, torch.reciprocal,
            torch.Tensor.reciprocal, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.sqrt, torch.Tensor.sqrt,
            torch.log, torch.Tensor.log, torch.log2, torch.Tensor.log2, torch.log10, torch.Tensor.log10, torch.log1p,
            torch.Tensor.log1p, torch.xlogy, torch.Tensor.xlogy, torch.special.xlogy, torch.prod, torch.Tensor.prod,
            torch.cumprod, torch.Tensor.cumprod, torch.std, torch.Tensor.std, torch.atan2, torch.Tensor.atan2,
            torch.arctan2, torch.Tensor.arctan2, torch.asin, torch.Tensor.asin, torch.arcsin, torch.Tensor.arcsin,
            torch.acos, torch.Tensor.acos, torch.arccos, torch.Tensor.arccos, torch.atanh, torch.Tensor.atanh,
            torch.arctanh, torch.Tensor.arctanh, torch.erfinv, torch.Tensor.erfinv, torch.special.erfinv,
            torch.lgamma, torch.Tensor.lgamma, torch.digamma, torch.Tensor.digamma, torch.polygamma,
            torch.Tensor.polygamma, torch.mvlgamma, torch.Tensor.mvlgamma, torch.special.gammaln,
            torch.special.digamma, torch.special.psi, torch.special.polygamma, torch.special.multigammaln,
            F.binary_cross_entropy, F.gaussian_nll_loss, F.poisson_nll_loss, F.ctc_loss, F.grid_sample, torch.cdist,
            F.lp_pool1d, F.lp_pool2d, F.lp_pool3d, torch.dist, torch.Tensor.dist, torch.logit, torch.Tensor.logit,
            torch.special.logit, torch.special.ndtri, torch.special.log_ndtr, torch.hypot, torch.Tensor.hypot,
            torch.addcdiv, torch.Tensor.addcdiv, torch.Tensor.addcdiv_, torch.acosh, torch.Tensor.acosh, torch.arccosh,
            torch.Tensor.arccosh, torch.tan, torch.Tensor.tan, torch.sinc, torch.Tensor.sinc, torch.special.sinc,
            F.softsign, torch.float_power, torch.Tensor.float_power, *_BY_INDEX, *LINEAR_ALGEBRA, *_SQUARING,
            F.softplus),
           "the backward divides by a value the op saves (a divisor, a reciprocal's or square root's result, a "
           "log's input, a product's factors, binary cross-entropy's probabilities, a Gaussian's variance, a "
           "distance), inverts it (a matrix, a triangular factor, gaps between eigenvalues or singular values), "
           "is singular in it (asin's 1 - x**2, atan2's x**2 + y**2, digamma's poles) or picks a grid "
           "cell by it (grid_sample's grid): a value small next to its group's range, or near a pole, gets a "
           "rounding error that no bits bound (a probability of 1e-3 at 8 bits in [0, 1]: 4x its value), so the "
           "gradient goes wrong or NaN: the value is kept exact; so is the base of a square such an op reads "
           "(sqrt(x ** 2 + eps), a Charbonnier loss: its gradient there is x's error over the root), and a "
           "softplus's input (a learned scale softplus(s) + eps: its derivative, exp(s) below 0, times 1 / var)"),
)


@dataclass(frozen=True)
class OpMatch:
    """A rule-matched call in progress: the tensors it saves that the rule treats, and how."""

    rule: OpRule
    targets: tuple[torch.Tensor, ...]
    encoding: Encoding | Derivative | None = None
    by_shape: bool = False
    """An in-place call saves a clone of its input: any saved tensor of the target's shape and dtype."""
    views: bool = False
    """A view or cast of a target matches too (a layer saves its weight transposed; under autocast, cast)."""
    keep: tuple[torch.Tensor, ...] = ()
    """Saved tensors the rule keeps exact (a decomposed norm's rstd, one value per row)."""
    keep_all: bool = False
    """Every tensor saved inside the call is kept exact (``rsqrt`` saves only its output)."""
    statistics: int = 0
    """Other saved tensors of at most this many values are the op's statistics (a normalisation's mean
    and rstd, one value per normalised row) and are kept exact."""
    call: Any = None
    """What runs instead of the function (an operator-level saving), if anything."""
    integers: bool = False
    """The int64 tensors the call saves (a max pool's indices) are the ones the rule treats."""
    computed: bool = False
    """The call saves a tensor of a target's shape that it computed without a graph (an activation's derivative,
    ``NOTE [ Activations that save their derivative ]`` in ``activation_derivative.py``): quantized as the target
    would be, not kept as a constant."""
    slices: bool = False
    """A slice of a target matches too (recomputed attention saves its chunks' q and k apart, ``NOTE [ Chunks
    stored apart ]`` in ``recomputed_attention.py``)."""
    inverts: bool = False
    """The call inverts what it saves (a decomposition, an inverse, a solve): ``NOTE [ Products before a singular
    backward ]`` in ``singular.py``."""
    exact_result: bool = False
    """The call's result is kept exact wherever the forward saves it (``NOTE [ Quotients by a kept divisor ]`` in
    ``hooks.py``)."""
    held: bool = False
    """The call squares a tensor (``x * x``, ``x ** 2``, ``square``) or is a softplus: what it saves is held for the
    next few saves, for a singular op that reads its result (``NOTE [ Saves held for a singular backward ]`` in
    ``singular.py``)."""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def _is_target(t: torch.Tensor, x: torch.Tensor) -> bool:
    """``t`` is the target ``x``, a contiguous reshape of it (``instance_norm`` hands ``batch_norm`` its
    input viewed as one sample of ``N * C`` channels: the same values in the same memory order, which is
    all the encodings read; a copy in ``x``'s logical order where ``x`` is not contiguous), or a copy the
    op made of it (``NOTE [ Copies an op saves ]``)."""
    if _same(t, x):
        return True
    if (t.data_ptr() == x.data_ptr() and t.numel() == x.numel() and t.dtype == x.dtype
            and t.is_contiguous() and x.is_contiguous()):
        return True
    return copy_of(t, x, same_shape=True) or (t.shape != x.shape and copy_of(t, x, same_order=True))


def _slice_of(t: torch.Tensor, x: torch.Tensor) -> bool:
    """``t`` is a slice of ``x`` (``x[a:b, c:d, ...]``): the same memory, dtype, dims and strides, and its elements
    among ``x``'s (its offset in ``x`` decomposed along ``x``'s strides, largest first, which is exact for a
    permutation of a contiguous tensor and its slices)."""
    if t.dtype != x.dtype or t.dim() != x.dim() or t.stride() != x.stride() or t.device != x.device:
        return False
    if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return False
    offset = t.storage_offset() - x.storage_offset()
    for d in sorted(range(x.dim()), key=lambda d: -x.stride(d)):
        size, stride = x.shape[d], x.stride(d)
        at = offset // stride if size > 1 and stride > 0 else 0
        if at < 0 or at + t.shape[d] > size:
            return False
        offset -= at * stride
    return offset == 0


def computed(match: OpMatch | None, t: torch.Tensor) -> bool:
    """``t`` is what the call of ``match`` computed without a graph in its target's place (``OpMatch.computed``)."""
    return match is not None and match.computed and match_saved(match, t) is not None


def keeps(match: OpMatch | None, t: torch.Tensor) -> bool:
    """The rule of ``match`` keeps ``t`` exact."""
    if match is None:
        return False
    if match.keep_all or any(_is_target(t, x) for x in match.keep):
        return True
    return 0 < stored_numel(t) <= match.statistics and match_saved(match, t) is None


def match_saved(match: OpMatch | None, t: torch.Tensor) -> OpMatch | None:
    """``match`` if ``t`` is one of the tensors its rule treats (else ``None``)."""
    if match is None:
        return None
    if match.integers:
        return match if t.dtype == torch.int64 else None
    if match.computed:
        return match if any(t.shape == x.shape for x in match.targets) else None
    if match.by_shape:
        return match if any(t.shape == x.shape and t.dtype == x.dtype for x in match.targets) else None
    if match.views:
        return match if any(_is_target(t, x) or copy_of(t, x) for x in match.targets) else None
    if match.slices:
        return match if any(_is_target(t, x) or _slice_of(t, x) for x in match.targets) else None
    return match if any(_is_target(t, x) for x in match.targets) else None


def _rows(x: torch.Tensor, n: int, center: bool) -> Normalized | None:
    if n < 1 or n > x.dim():
        return None
    cols = math.prod(x.shape[x.dim() - n:])
    if cols < 2:
        return None
    return Normalized((x.numel() // max(1, cols), 1, cols), (2,), center)


def _over(x: torch.Tensor, dims: list[int]) -> Normalized | None:
    """``x`` stored divided by its RMS over ``dims`` (one block of consecutive dims), if they are."""
    if not dims or dims != list(range(dims[0], dims[-1] + 1)):
        return None
    outer, size = math.prod(x.shape[:dims[0]]), math.prod(x.shape[dims[0]:dims[-1] + 1])
    if size < 2 or size == x.numel():
        return None  # one statistic for the whole tensor: its error averages over all of it
    inner = x.numel() // max(1, outer * size)
    if inner == 1:  # trailing dims: the rows encoding, so that other rules' saves of x share one record
        return _rows(x, x.dim() - dims[0], center=False)
    return Normalized((outer, size, inner), (1,), center=False)


def _normalization(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Normalized | None:
    x = _arg(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.numel() == 0:
        return None
    if func is F.layer_norm or func is F.rms_norm:
        shape = _arg(args, kwargs, 1, "normalized_shape")
        n = 1 if isinstance(shape, int) else len(shape) if shape is not None else 1
        return _rows(x, n, center=func is F.layer_norm)
    if func is F.normalize:  # each vector along dim scaled to unit norm
        dim = _arg(args, kwargs, 2, "dim", 1)
        if not isinstance(dim, int) or not -x.dim() <= dim < x.dim() or not x.is_floating_point():
            return None
        return _over(x, [dim % x.dim()])
    if x.dim() < 2:
        return None
    n, c = x.shape[0], x.shape[1]
    rest = x.numel() // max(1, n * c)
    if func is F.group_norm:
        groups = int(_arg(args, kwargs, 1, "num_groups"))
        return Normalized((n, groups, x.numel() // max(1, n * groups)), (2,))
    if func is F.instance_norm:
        return Normalized((n, c, rest), (2,))
    # batch_norm: batch statistics (training, or no running statistics) normalise per channel
    training = bool(_arg(args, kwargs, 5, "training", False))
    if not training and _arg(args, kwargs, 1, "running_mean") is not None:
        return None
    return Normalized((n, c, rest), (0, 2))


def _statistic(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, Normalized] | None:
    """A vector norm of ``x`` along some of its dims, or ``a / s`` where ``s`` has size 1 along one
    block of dims of ``a`` and ``a``'s size elsewhere: ``x`` (``a``) and its encoding over those dims."""
    if func in (torch.norm, torch.Tensor.norm, torch.linalg.vector_norm):
        x = _arg(args, kwargs, 0, "input" if func is not torch.linalg.vector_norm else "x")
        dim = _arg(args, kwargs, 2, "dim")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 or dim is None:
            return None
        dims = sorted({d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim)})
        enc = _over(x, dims)
        return (x, enc) if enc is not None else None
    a, s = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if not (isinstance(a, torch.Tensor) and isinstance(s, torch.Tensor)) or not a.is_floating_point():
        return None
    if _arg(args, kwargs, 2, "rounding_mode") is not None or s.dim() > a.dim() or s.numel() < 2:
        return None
    shape = (1,) * (a.dim() - s.dim()) + tuple(s.shape)
    reduced = [d for d in range(a.dim()) if shape[d] == 1 and a.shape[d] > 1]
    if any(shape[d] != a.shape[d] for d in range(a.dim()) if d not in reduced):
        return None
    enc = _over(a, reduced)
    return (a, enc) if enc is not None else None


_RSQRT_NODES = frozenset({"RsqrtBackward0"})


def _decomposed_rms(func: Any, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, Normalized, torch.Tensor | None] | None:
    r = None
    if func in (torch.Tensor.pow, torch.pow, torch.Tensor.__pow__):
        x, e = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "exponent")
        if not (isinstance(x, torch.Tensor) and isinstance(e, (int, float)) and e == 2):
            return None
    else:
        a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        if b.grad_fn is not None and type(b.grad_fn).__name__ in _RSQRT_NODES:
            x, r = a, b
        elif a.grad_fn is not None and type(a.grad_fn).__name__ in _RSQRT_NODES:
            x, r = b, a
        else:
            return None
        if x.dim() < 1 or r.shape != (*x.shape[:-1], 1):
            return None
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] < 8:
        return None
    enc = _rows(x, 1, center=False)
    return (x, enc, r) if enc is not None else None


def _clip_bounds(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any, bool] | None:
    if func in (F.hardtanh, F.hardtanh_):
        return _arg(args, kwargs, 1, "min_val", -1.0), _arg(args, kwargs, 2, "max_val", 1.0), False
    if func is F.relu6:
        return 0.0, 6.0, False
    if func is F.hardsigmoid:
        return -3.0, 3.0, False
    if func in (F.leaky_relu, F.leaky_relu_):  # a negative slope is refused in place, and flips signs
        slope = _arg(args, kwargs, 1, "negative_slope", 0.01)
        return (0.0, None, False) if isinstance(slope, (int, float)) and slope >= 0 else None
    if func is F.threshold:  # the backward compares the input with the threshold, whatever replaces it; in place
        # it compares the output, which reads the same where the replacement is 0
        value, inplace = _arg(args, kwargs, 2, "value"), bool(_arg(args, kwargs, 3, "inplace", False))
        return (_arg(args, kwargs, 1, "threshold"), None, False) if value == 0 or not inplace else None
    if func in _ABSOLUTE:
        return 0.0, None, False
    if func in _NORMS:  # an L1 norm's backward is the sign of its input
        order = _arg(args, kwargs, 1, "p" if func is not torch.linalg.vector_norm else "ord", 2)
        return (0.0, None, False) if order == 1 and not isinstance(order, bool) else None
    if func in _CLAMP_MIN:
        return _arg(args, kwargs, 1, "min"), None, True
    if func in _CLAMP_MAX:
        return None, _arg(args, kwargs, 1, "max"), True
    if func in _SHRINKS:  # the gradient passes outside [-lambd, lambd]: the same mask, read the other way
        lambd = _arg(args, kwargs, 1, "lambd", 0.5)
        return (-lambd, lambd, True) if isinstance(lambd, (int, float)) and lambd > 0 else None
    return _arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max"), True


# An L1 loss saves the difference of its input and target (of the input's shape, made inside the call) for its
# absolute value.
_ABSOLUTE = frozenset({torch.abs, torch.Tensor.abs, torch.Tensor.__abs__, torch.absolute, torch.Tensor.absolute,
                       torch.Tensor.abs_, F.l1_loss})
_SHRINKS = frozenset({F.hardshrink, torch.Tensor.hardshrink, F.softshrink})


def _clip(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ClipMask | None:
    x = _arg(args, kwargs, 0, "input")
    bounds = _clip_bounds(func, args, kwargs)
    if bounds is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    lo, hi, inclusive = bounds
    if any(b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))) for b in (lo, hi)):
        return None  # tensor bounds: their own gradients read the values
    if lo is None and hi is None:
        return None
    if lo is not None and hi is not None:
        if not lo < hi:
            return None
        inside, outside = (lo + hi) / 2, lo - max(1.0, abs(lo))
    elif lo is not None:
        inside, outside = lo + max(1.0, abs(lo)), lo - max(1.0, abs(lo))
    else:
        inside, outside = hi - max(1.0, abs(hi)), hi + max(1.0, abs(hi))
    enc = ClipMask(None if lo is None else float(lo), None if hi is None else float(hi), inclusive, inside, outside,
                   tie=0.0 if func in _ABSOLUTE or func in _NORMS else None)  # the sign of 0 is 0
    # The restored values must compare as the originals did in the tensor's own dtype.
    probe = torch.tensor([inside, outside], dtype=x.dtype, device="cpu")
    if probe.isfinite().all() and enc.mask(probe).tolist() == [True, False]:
        return enc
    return None


def _comparison(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                ) -> tuple[torch.Tensor, ClipMask] | None:
    """The input of ``max``/``min``/``maximum``/``minimum`` against a 0-d tensor (not a dim: an int
    ``other`` of ``max``/``min`` is a reduction), with the encoding of its comparison."""
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or len(args) + len(kwargs) != 2:
        return None
    x, c = (a, b) if b.dim() == 0 and a.dim() > 0 else (b, a) if a.dim() == 0 and b.dim() > 0 else (None, None)
    if x is None or c is None or not x.is_floating_point() or c.dtype != x.dtype:
        return None
    here = c.detach().cpu()  # one value per call (a device sync on an accelerator)
    value = here.item()
    if not math.isfinite(value):
        return None
    above = torch.nextafter(here, torch.tensor(math.inf, dtype=c.dtype, device="cpu"))
    below = torch.nextafter(here, torch.tensor(-math.inf, dtype=c.dtype, device="cpu"))
    upper = func in (torch.min, torch.minimum, torch.Tensor.min, torch.Tensor.minimum)
    if upper:  # the input's gradient flows where x < c
        return x, ClipMask(None, value, False, below.item(), above.item(), tie=value)
    return x, ClipMask(value, None, False, above.item(), below.item(), tie=value)


_DERIVATIVE_KINDS = {F.silu: "silu", F.hardswish: "hardswish", F.mish: "mish"}


def _derivative(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Derivative | None:
    x = _arg(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    if func in _DERIVATIVE_KINDS:
        return Derivative(_DERIVATIVE_KINDS[func])
    approximate = _arg(args, kwargs, 1, "approximate", "none")
    return Derivative("gelu") if approximate == "none" else Derivative("gelu_tanh") if approximate == "tanh" else None


_POOL_DIMS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.max_pool1d_with_indices: 1,
              F.max_pool2d_with_indices: 2, F.max_pool3d_with_indices: 3}


def _pool_windows(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> PoolWindows | None:
    """A max pool's windows (the saved indices give their shape and memory order), or ``None``."""
    x, dims = _arg(args, kwargs, 0, "input"), _POOL_DIMS[func]
    if not isinstance(x, torch.Tensor) or x.dim() not in (dims + 1, dims + 2):
        return None

    def per_dim(value: Any, default: Any) -> tuple[int, ...] | None:
        value = default if value is None or (isinstance(value, (tuple, list)) and not value) else value
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims
        ok = len(values) == dims and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        return values if ok else None

    kernel = per_dim(_arg(args, kwargs, 1, "kernel_size"), None)
    stride = per_dim(_arg(args, kwargs, 2, "stride"), kernel)
    padding, dilation = per_dim(_arg(args, kwargs, 3, "padding"), 0), per_dim(_arg(args, kwargs, 4, "dilation"), 1)
    if kernel is None or stride is None or padding is None or dilation is None or math.prod(kernel) > 256:
        return None
    return PoolWindows(tuple(x.shape[-dims:]), kernel, stride, padding, dilation)


def _unit_vectors(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two operands of a ``matmul``, ``bmm`` or two-operand ``einsum`` call, if both are (views of) vectors
    divided by their norm."""
    if func is torch.einsum:
        operands = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    else:
        operands = (_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "mat2" if func in _BMM else "other"))
    if len(operands) != 2 or not all(
            isinstance(t, torch.Tensor) and t.is_floating_point()
            and reaches(t.grad_fn, _divides_by_norm, CAST_AND_VIEW_NODES, _MAX_VIEWS) for t in operands):
        return None
    return operands[0], operands[1]


_MAX_VIEWS = 4
_NORM_NODES = frozenset({"LinalgVectorNormBackward0", "NormBackward0", "NormBackward1", "NormBackward2"})
_DIVISOR_NODES = frozenset({"ExpandBackward0", "ClampMinBackward0", "ToCopyBackward0"})


def _divides_by_norm(node: object) -> bool:
    """``node`` divides by a vector norm (clamped and expanded, as ``F.normalize`` does, or not; cast or not)."""
    if type(node).__name__ != "DivBackward0":
        return False
    inputs = node.next_functions  # type: ignore[attr-defined]
    return len(inputs) == 2 and reaches(inputs[1][0], lambda n: type(n).__name__ in _NORM_NODES, _DIVISOR_NODES, 3)


_BMM = (torch.bmm, torch.Tensor.bmm)


# Where the ``inplace`` flag sits among the positional arguments of clips that have one.
_INPLACE_ARG = {F.hardtanh: 3, F.relu6: 1, F.threshold: 3, F.leaky_relu: 2, F.hardsigmoid: 1}


def _match(rule: OpRule, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> OpMatch | None:
    if rule.name == "singular_backward":
        return _singular(rule, func, args, kwargs)
    if rule.name == "extremum":
        if reads_positions(func, args, dict(kwargs), _EXTREMA):
            return OpMatch(rule, (), keep_all=True)
        call = extremum_saving_positions(func, args, dict(kwargs))
        return OpMatch(rule, (), call=call) if call is not None else None
    if rule.name == "activation_derivative":
        found = _derivative(func, args, kwargs)  # in place: autograd saves a clone of the input
        if found is None:
            return None
        x = _arg(args, kwargs, 0, "input")
        if func is not F.gelu and bool(_arg(args, kwargs, 1, "inplace", False)):
            return OpMatch(rule, (x,), found, by_shape=True)
        if not (x.requires_grad and torch.is_grad_enabled()):
            return OpMatch(rule, (x,), found)  # nothing is saved
        return OpMatch(rule, (x,), found, computed=True)  # the tracer runs it saving f'(x) (``derivative``)
    if rule.name == "normalization":
        x = _arg(args, kwargs, 0, "input")
        enc = _normalization(func, args, kwargs)
        if enc is None:
            return None
        rows = math.prod(n for i, n in enumerate(enc.view) if i not in enc.reduce)
        return OpMatch(rule, (x,), enc, statistics=rows)
    if rule.name == "decomposed_rms_norm":
        if func in (torch.rsqrt, torch.Tensor.rsqrt):
            return OpMatch(rule, (), keep_all=True)
        found = _decomposed_rms(func, args, kwargs)
        if found is None:
            return None
        return OpMatch(rule, (found[0],), found[1], keep=() if found[2] is None else (found[2],))
    if rule.name == "statistic_of_rows":
        found = _statistic(func, args, kwargs)
        if found is None:
            return None
        enc = found[1]
        return OpMatch(rule, (found[0],), enc, statistics=enc.view[0] * enc.view[2])
    if rule.name == "comparison":
        compared = _comparison(func, args, kwargs)
        if compared is not None:
            return OpMatch(rule, (compared[0],), compared[1])
        call = pairwise_extremum_saving_comparisons(func, args, dict(kwargs))
        return OpMatch(rule, (), call=call) if call is not None else None
    if rule.name == "computed_weight":
        weight = _arg(args, kwargs, 2 if func is F.bilinear else 1, "weight")
        computed = isinstance(weight, torch.Tensor) and weight.grad_fn is not None
        return OpMatch(rule, (weight,), views=True) if computed else None
    if rule.name == "exponentiated":
        return _exponentiated(rule, func, args, kwargs)
    if rule.name == "cosine_product":
        operands = _unit_vectors(func, args, kwargs)
        return OpMatch(rule, operands, views=True) if operands is not None else None
    if rule.name == "pool_indices":
        windows = _pool_windows(func, args, kwargs)
        return OpMatch(rule, (), windows, integers=True) if windows is not None else None
    if rule.name == "cross_entropy":
        logits = saves_logits(args, dict(kwargs))
        return OpMatch(rule, (logits,), call=cross_entropy_saving_logits) if logits is not None else None
    if rule.name == "attention_qk":
        q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
        targets = tuple(t for t in (q, k) if isinstance(t, torch.Tensor))
        return OpMatch(rule, targets) if targets else None
    if func in _MARGIN_LOSSES:  # clip_mask, from here on
        return OpMatch(rule, (), keep_all=True)
    if func in _JUMPS:  # NOTE [ Derivatives that jump at 0 ] in jumps.py
        call = saving_sides(func, args, dict(kwargs))
        return OpMatch(rule, (), call=call) if call is not None else None
    x = _arg(args, kwargs, 0, "input")
    enc = _clip(func, args, kwargs)
    inplace = func in (F.hardtanh_, torch.Tensor.clamp_, torch.Tensor.clip_, F.leaky_relu_, torch.Tensor.abs_,
                       torch.Tensor.clamp_min_, torch.Tensor.clamp_max_, F.l1_loss) or bool(
        _arg(args, kwargs, _INPLACE_ARG[func], "inplace", False) if func in _INPLACE_ARG else False)
    return OpMatch(rule, (x,), enc, by_shape=inplace) if enc is not None else None


def _exponentiated(rule: OpRule, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> OpMatch | None:
    """A logsumexp's input at 8 bits or more, with its result: logcumsumexp's, of the input's shape, by shape too;
    logsumexp's, one value per reduced row, kept exact as a statistic."""
    x = _arg(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return None
    if func in (torch.logcumsumexp, torch.Tensor.logcumsumexp):
        return OpMatch(rule, (x,), by_shape=True)
    dim = _arg(args, kwargs, 1, "dim", ())
    dims = reduced_dims(x.dim(), dim)
    return OpMatch(rule, (x,), statistics=x.numel() // max(1, math.prod(x.shape[d] for d in dims)))


_DIVISIONS = frozenset({torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide,
                        torch.Tensor.true_divide, torch.Tensor.div_, torch.Tensor.__itruediv__})
_POWERS = frozenset({torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.float_power, torch.Tensor.float_power})


def _squares(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether the call squares a tensor: ``square(x)``, ``x * x`` (one tensor twice), ``x ** 2``."""
    if func in (torch.square, torch.Tensor.square):
        return True
    if func in (torch.pow, torch.Tensor.pow, torch.Tensor.__pow__):
        exponent = _arg(args, kwargs, 1, "exponent")
        return isinstance(exponent, (int, float)) and exponent == 2
    if func in _SQUARING:
        a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
        return isinstance(a, torch.Tensor) and a is b
    return False


# NOTE [ Singular backward ]
# Rounding adds an error of the order of a group's range / 2**bits to each saved value, whatever the value. Where
# backward divides by the value (``a / b``'s gradient is ``g / b`` and ``-g a / b**2``; a log's ``g / x``; a square
# root's ``g / (2 sqrt(x))``; ``prod``'s ``g * prod / x``; binary cross-entropy's ``(p - y) / (p (1 - p))``;
# a Gaussian's variance) or is singular in it (asin's ``1 / sqrt(1 - x**2)``, atan2's ``x**2 + y**2``, lgamma's
# digamma, erfinv's ``exp(y**2)``), that error is multiplied by a factor that grows without bound as the value
# nears the singularity: a probability of 1e-3 rounded at 8 bits in a group spanning [0, 1] is off by up to 4x
# itself (or its sign), and those are the values whose gradient terms dominate. More bits move the threshold, not
# the failure: measured at 8 bits, a sigmoid then binary cross-entropy gave an input gradient of cosine -0.16
# against plain PyTorch's, ``Normal(mu, sigma).log_prob`` 0.01, asin NaN, and the linear algebra that inverts what
# it saves (a solve, a Cholesky factor) or divides by gaps between eigenvalues (eigh: NaN) likewise
# (``docs/saved.md``). So the tensors these
# calls save are kept exact, with three narrower cases. A division keeps its divisor, and its dividend only where
# the two are of one size: the dividend's error enters ``-g a / b**2`` linearly and averages over the elements a
# broadcast divisor (a scalar, a learned temperature) sums it over, but an elementwise quotient of related values
# (``x / (|x| + eps)``) has its small dividends where its small divisors are. A power keeps its base only where its
# exponent is a tensor or below 1 (``x ** 2``'s gradient is linear in x). A grid sample keeps its grid (the cell a
# point falls in, and so which input values its gradient reads, moves with the rounding; the input enters
# linearly). A division by a statistic of the dividend's rows and ``x ** 2`` of an RMSNorm written out are taken
# first by their own rules.
def _singular(rule: OpRule, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> OpMatch | None:
    """The ``singular_backward`` match of a call (``NOTE [ Singular backward ]``): what it keeps exact."""
    if func in _DIVISIONS:
        dividend, divisor = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
        if not isinstance(divisor, torch.Tensor):
            return None
        elementwise = isinstance(dividend, torch.Tensor) and dividend.numel() == divisor.numel()
        return OpMatch(rule, (), keep=(dividend, divisor) if elementwise else (divisor,), exact_result=elementwise)
    if func is F.softplus or _squares(func, args, kwargs):
        return OpMatch(rule, (), held=True)  # NOTE [ Saves held for a singular backward ] in singular.py
    if func in _SQUARING:
        return None
    if func in _POWERS:
        exponent = _arg(args, kwargs, 1, "exponent")
        if isinstance(exponent, (int, float)) and (exponent == 0 or exponent >= 1):
            return None  # a gradient polynomial in the base
        return OpMatch(rule, (), keep_all=True)
    if func in _BY_INDEX:  # a product through an index divides by its factors, as prod does
        return OpMatch(rule, (), keep_all=True) if reads_positions(func, args, dict(kwargs), _PRODUCT) else None
    if func is F.grid_sample:
        grid = _arg(args, kwargs, 1, "grid")
        return OpMatch(rule, (), keep=(grid,)) if isinstance(grid, torch.Tensor) else None
    return OpMatch(rule, (), keep_all=True, inverts=func in _INVERTING)


_INVERTING = frozenset(LINEAR_ALGEBRA)


# NOTE [ Tracing the saving op ]
# A pack hook sees the tensor autograd saves, not the op saving it: for a saved output ``t.grad_fn`` is
# that op's node, but an op's *inputs* are saved before its node is visible (and before a
# ``TorchDispatchMode`` would see the op). So while a ``compress`` context quantizes, a
# ``TorchFunctionMode`` notes the rule-matched call in progress (a dict lookup for any other call), and
# the pack hooks run inside that call read it. The mode sees the outermost torch function: the saves
# of ``F.layer_norm`` happen inside it, those of a function that calls it internally belong to that outer
# function and follow no rule. One such function is opened (``OPENED``): ``F.multi_head_attention_forward``
# (``nn.MultiheadAttention``, ``nn.Transformer*`` layers) calls ``F.scaled_dot_product_attention`` inside.
# A mode's handler runs with the mode off, and the function's first statement hands any call made with a mode
# on back to the mode, so it is run as a copy of itself whose ``has_torch_function`` answers no, with the mode
# on: its own calls (its SDPA among them) reach the rules. Where the function has no such check by that name
# (another PyTorch), it runs closed, as before.
OPENED = (F.multi_head_attention_forward,)


@functools.cache
def _opened(func: Any) -> Any:
    """``func`` without its own override check, or ``None`` where it has none by the name it is looked for."""
    code = getattr(func, "__code__", None)
    if code is None or "has_torch_function" not in code.co_names:
        return None
    opened = types.FunctionType(code, {**func.__globals__, "has_torch_function": lambda *args: False},
                                func.__name__, func.__defaults__, func.__closure__)
    opened.__kwdefaults__ = func.__kwdefaults__
    return opened


# NOTE [ Operator-level savings under other hooks ]
# A rule that runs a call as a function of its own (``OpMatch.call``: attention recomputed from its inputs, a
# cross-entropy that saves its logits, an activation that saves its derivative) saves other tensors than the call
# does, which only daftrain's own hooks are ready for. Inside another saved-tensor hook context entered in
# ``compress`` (a ``torch.utils.checkpoint`` region: only the innermost hooks apply), those saves are that
# context's, and a checkpoint recomputes the region in backward outside the rules, as plain PyTorch: its recomputed
# saves would take the places of the function's (plain SDPA's in the recomputed attention's, an activation's input
# in the place of its derivative), a wrong gradient without an error. So a call runs as the rule's function only
# where a tensor saved now reaches daftrain's hooks (``compress``'s, or a ``daftrain.checkpoint`` region's, which
# recomputes under the rules) or no hooks at all (``ExactSavings``: plain autograd saves); anywhere else it runs as
# it is.
# NOTE [ Linalg calls that check their result ]
# ``torch.linalg.inv``, ``solve``, ``cholesky`` and the other linalg functions that raise on a singular input (each
# has an ``_ex`` twin that returns the error code instead) check their result with ``aten._linalg_check_errors``,
# which AOTAutograd threads through the graph as an effect token: one more forward output. When saved-tensor hooks
# are inlined into the graph (``NOTE [ Hooks inside compiled graphs ]`` in compiled.py), AOTAutograd picks the saves
# to offer them by counting the forward's outputs without that token, one place off: compiling any such graph
# under ``compress`` failed with an ``IndexError`` from inside PyTorch. So while compiling, these calls break the
# graph: they run eagerly, under the eager hooks and the op rules, and the graphs around them compile. Exact mode
# (``bits=None``) has no rule mode to break them out: compiling them under it still fails.
_CHECKED_LINALG = frozenset(
    [getattr(torch.linalg, name[:-3]) for name in dir(torch.linalg)
     if name.endswith("_ex") and hasattr(torch.linalg, name[:-3])]
    + [torch.inverse, torch.Tensor.inverse, torch.linalg.tensorinv, torch.linalg.tensorsolve])


def _called_eagerly(mode: _RuleMode, func: Any, types: Any, args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> Any:
    """``func`` called through ``mode``'s handler outside any graph (NOTE [ Linalg calls that check their result ])."""
    return mode.__torch_function__(func, types, args, kwargs)


# NOTE [ Rules while compiling ]
# Dynamo traces a torch function mode's handler into the graph it compiles, and guards on what the handler read: a
# lookup of the called function in the rules' table became a guard on that table's keys, which failed on the frame
# that made it for the functions whose bound and unbound forms differ (``x ** 0.5`` under ``torch.compile``:
# "Guard failed on the same frame it was created"). So the handler asks whether it is being compiled before it
# reads anything else.
class _RuleMode(TorchFunctionMode):
    def __init__(self, tracer: OpTracer, by_function: dict[Any, tuple[OpRule, ...]]) -> None:
        super().__init__()
        self.tracer, self.by_function = tracer, by_function

    @never_a_frame  # NOTE [ Callbacks in a compiled function's eager code ] in callbacks.py
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # compiled graphs decide without the rules (NOTE [ Rules while compiling ])
            if func in _CHECKED_LINALG:  # NOTE [ Linalg calls that check their result ]
                return torch._dynamo.disable(_called_eagerly)(self, func, types, args, kwargs)
            return func(*args, **kwargs)
        return eagerly(self._eager, func, args, kwargs)

    def _eager(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The handler outside any compiled graph: ``func`` under the rule it matches."""
        rules = self.by_function.get(func)
        linear = func in self.tracer.linears
        if rules is None and not linear:
            opened = _opened(func) if func in OPENED else None
            if opened is None:
                return func(*args, **kwargs)
            with self:  # NOTE [ Tracing the saving op ]: its own calls reach the rules
                return opened(*args, **kwargs)
        if not _strided(args, kwargs):  # NOTE [ Nested and sparse arguments ]
            return func(*args, **kwargs)
        found = None
        for rule in rules or ():
            found = _match(rule, func, args, kwargs)
            if found is not None:
                break
        if found is not None and found.rule.name == "cross_entropy":
            found = self.tracer.over_linear(found)
        elif found is not None and found.rule.name == "attention_qk":
            found = self.tracer.attention(found, args, kwargs)
        elif found is not None and found.computed:
            found = self.tracer.derivative(found)
        if found is not None and not found.held and _squares(func, args, kwargs):
            found = replace(found, held=True)  # ``x ** 2`` of an RMSNorm written out is a square too
        if found is not None and found.call is not None and not saves_reach_daftrain():
            found = None  # NOTE [ Operator-level savings under other hooks ]
        if found is None:
            out = func(*args, **kwargs)
        else:
            local = self.tracer.local
            outer = getattr(local, "current", None)
            local.current = found
            try:
                out = (found.call or func)(*args, **kwargs)
            finally:
                local.current = outer
            if found.exact_result and isinstance(out, torch.Tensor) and self.tracer.exact_result is not None:
                self.tracer.exact_result(out)
        if linear:
            self.tracer.note_linear(args, kwargs, out)
        return out


# NOTE [ Nested and sparse arguments ]
# The rules' functions (attention recomputed from its inputs, an activation saving its derivative, the
# normalisations' encodings) are written for strided tensors, and ``decide`` keeps what a nested (jagged) or sparse
# tensor saves as it is (reason ``layout``). A call with such an argument runs as it is: before, a GELU of a jagged
# tensor raised inside the function that saves its derivative.
def _strided(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """No tensor among the arguments (or in a list or tuple of them) is nested or of a layout other than strided."""
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and (t.is_nested or t.layout != torch.strided):
                return False
    return True


_LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _wide_linear(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 out: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The input, weight and bias of a differentiable floating-point ``F.linear`` call whose output takes more
    bytes at ``LOGITS_MIN_BITS`` than its input exact (``NOTE [ Cross-entropy over a wide linear layer ]``)."""
    x, w, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(out, torch.Tensor)):
        return None
    if b is not None and not isinstance(b, torch.Tensor):
        return None
    if not (out.requires_grad and torch.is_grad_enabled() and w.dim() == 2 and x.dim() >= 1):
        return None
    if out.dtype not in _LINEAR_DTYPES or any(
            t.dtype not in (torch.float32, out.dtype) or t.layout != torch.strided or t.device != out.device
            for t in (x, w, out, *(() if b is None else (b,)))):
        return None  # float32, or a half-precision output (under autocast, of float32 inputs)
    return (x, w, b) if _wide(w, x.element_size()) else None


def _wide(weight: torch.Tensor, input_bytes: int) -> bool:
    """A linear layer of this weight, over inputs of ``input_bytes`` a value, has more bytes of output at
    ``LOGITS_MIN_BITS`` than of input exact."""
    return weight.shape[0] * LOGITS_MIN_BITS > 8 * weight.shape[1] * input_bytes


class OpTracer:
    """Per thread (``NOTE [ One tracer per thread ]`` in ``auto/tracing.py``), the rule-matched call in
    progress; see ``NOTE [ Tracing the saving op ]``. With ``linear_cross_entropy``, also the latest wide
    linear call (``NOTE [ Cross-entropy over a wide linear layer ]``)."""

    def __init__(self, rules: tuple[OpRule, ...] = RULES, linear_cross_entropy: bool = True, exact: bool = False,
                 linears: tuple[Any, ...] = (F.linear,), weight_grads_in_place: bool = False,
                 group_size: int = 256, traffic: Callable[[int], None] | None = None,
                 exact_result: Callable[[torch.Tensor], None] | None = None) -> None:
        self.rules = rules
        self.exact_result = exact_result
        """Told each result an ``OpMatch.exact_result`` call made."""
        self.linear_cross_entropy = linear_cross_entropy
        self.exact = exact
        """Only what keeps every value exact: a cross-entropy not over a wide linear call runs as plain's."""
        self.linears = linears
        """Torch functions with ``F.linear``'s arguments and result whose calls may be a cross-entropy's head."""
        self.weight_grads_in_place = weight_grads_in_place
        """A loss over a head adds the head's weight gradient into ``.grad`` itself, where it may."""
        self.local = threading.local()
        self._by_function: dict[Any, tuple[OpRule, ...]] = {}
        for rule in rules:  # in the table's order: a division by a row statistic before any other division
            for f in rule.functions:
                self._by_function[f] = (*self._by_function.get(f, ()), rule)
        self._attention = AttentionPrecision(ATTENTION_MIN_BITS, group_size)
        self._recomputed = functools.partial(attention_recomputed, traffic=traffic)
        """Attention run as a function that saves only its inputs, telling ``traffic`` the bytes its transients
        free (``NOTE [ Attention recomputed from its stored inputs ]``)."""
        self._traffic = traffic
        self._derivatives: dict[str, Callable[..., torch.Tensor]] = {}
        self._step = 0

    def start(self, step: int = 0) -> None:
        """Trace the calls of ``step``'s forward on this thread until ``stop``."""
        self.stop()
        mode = _RuleMode(self, self._by_function)
        mode.__enter__()
        self.local.mode, self.local.current = mode, None
        self.local.linears = LinearOutputs() if self.linear_cross_entropy else None
        self.local.attention_calls, self._step = 0, step

    def stop(self) -> None:
        mode = getattr(self.local, "mode", None)
        self.local.mode, self.local.current, self.local.linears = None, None, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def current(self) -> OpMatch | None:
        return getattr(self.local, "current", None)

    def note_linear(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        """Remember an ``F.linear`` call if it is wide (its output may be a cross-entropy's logits)."""
        linears = getattr(self.local, "linears", None)
        found = _wide_linear(args, kwargs, out) if linears is not None else None
        if linears is not None and found is not None:
            linears.note(*found, out)

    def attention(self, match: OpMatch, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> OpMatch:
        """An ``attention_qk`` match, run as a function that saves only q, k, v and its mask where it builds a
        graph (``NOTE [ Attention recomputed from its stored inputs ]``), a learned float mask rounded as far as
        it errs the logits little (else, and any other mask, kept as it is); one that keeps everything the call
        saves exact where 8 bits would err its logits too much (``NOTE [ Attention logits that need more than 8
        bits ]``)."""
        index = getattr(self.local, "attention_calls", 0)
        self.local.attention_calls = index + 1
        if len(match.targets) != 2:
            return match
        q, k = match.targets
        if q.is_meta or k.is_meta:  # no values to estimate from or to store: the call as it is
            return match
        if self._attention.exact(self._step, index, q, k, _arg(args, kwargs, 6, "scale")):
            match = replace(match, targets=(), keep_all=True)
        if not recomputes(args, dict(kwargs)):
            return match
        match = replace(match, slices=True)  # NOTE [ Chunks stored apart ]: q and k may be saved a chunk at a time
        mask = _arg(args, kwargs, 3, "attn_mask")
        if mask is None:
            return replace(match, call=self._recomputed)
        learned = mask.is_floating_point() and mask.requires_grad and not match.keep_all
        storage = self._attention.mask_storage(self._step, index, mask) if learned else MaskStorage.EXACT
        if storage is MaskStorage.ROUNDED:
            return replace(match, call=self._recomputed)
        if storage is MaskStorage.AT_MIN_BITS:
            return replace(match, call=self._recomputed, targets=(q, k, mask))
        return replace(match, call=self._recomputed, keep=(mask,))

    def derivative(self, match: OpMatch) -> OpMatch:
        """An out-of-place ``activation_derivative`` match (its encoding names the activation), run as a function
        that saves f'(x) itself, stored as plain values (``NOTE [ Activations that save their derivative ]``)."""
        assert isinstance(match.encoding, Derivative)
        kind = match.encoding.kind
        call = self._derivatives.get(kind)
        if call is None:
            call = self._derivatives[kind] = saving_derivative(kind, self._traffic)
        return replace(match, encoding=None, call=call)

    def over_linear(self, match: OpMatch) -> OpMatch | None:
        """A ``cross_entropy`` match run over the linear call that made its logits, where one did (else the
        match, or, ``exact``, none)."""
        linears = getattr(self.local, "linears", None)
        call = linears.take(match.targets[0]) if linears is not None else None
        if call is None:
            return None if self.exact else match
        keep = tuple(t for t in (call.input, call.weight, call.bias) if t is not None)
        return replace(match, targets=(), keep=keep, call=functools.partial(
            cross_entropy_over_linear, call, grad_in_place=self.weight_grads_in_place))


# NOTE [ Exact training with the loss over the head ]
# Of the op rules, one changes no value that backward reads: a cross-entropy over a wide linear layer's
# output run as a function of the layer's input, weight and bias (``NOTE [ Cross-entropy over a wide linear
# layer ]``), which saves the input exact and holds nothing of the logits' size in backward, its results
# plain's to float rounding. ``ExactSavings`` applies that one alone, without saved-tensor hooks: what exact
# training (``BudgetedStep``'s exact plans) can take of ``compress``'s operator-level savings. A language
# model's logits chain (the logits' gradient, the log-probabilities and their gradient) is most of an exactly
# checkpointed step's working set beyond the saved tensors.
class ExactSavings:
    """A context: inside it, a ``F.cross_entropy`` over the whole output of a wide ``F.linear`` (or of one of
    ``linears``, functions with its arguments and result) runs over that layer (``NOTE [ Exact training with the
    loss over the head ]``); everything else runs as plain PyTorch. With ``weight_grads_in_place`` the loss adds
    the head's weight gradient into ``.grad`` itself where it may (``NOTE [ Weight gradients accumulated in place
    ]`` in ``budget/weight_grads.py``). It may be entered again after it exits, on one thread at a time."""

    def __init__(self, linears: tuple[Any, ...] = (), weight_grads_in_place: bool = False) -> None:
        self._tracer = OpTracer(tuple(r for r in RULES if r.name == "cross_entropy"), exact=True,
                                linears=(F.linear, *linears), weight_grads_in_place=weight_grads_in_place)

    def __enter__(self) -> ExactSavings:
        self._tracer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracer.stop()


def may_have_wide_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a matrix that could be a wide linear layer's weight (``_wide_linear``, for an input
    of the weight's dtype): where none is, ``ExactSavings`` would only add a mode to every torch call."""
    return any(p.dim() == 2 and _wide(p, p.element_size()) for p in model.parameters())
