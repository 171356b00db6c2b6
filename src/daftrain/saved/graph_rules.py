"""Op rules inside compiled graphs: how the traced pack stores one saved value, read from AOTAutograd's
forward and backward graphs (``NOTE [ Op rules in compiled graphs ]``)."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from .decide import NONLINEAR_MIN_BITS
from .op_rules import ATTENTION_MIN_BITS
from .singular import sums_few_terms

__all__ = ["GraphRule", "graph_rule", "is_incoming_gradient"]


@dataclass(frozen=True)
class GraphRule:
    """How the traced pack stores one saved value: ``keep`` it, ``quantize`` it at ``min_bits`` or more,
    ``normalize`` it over ``dims`` (of the value, or of its ``(N, groups, -1)`` view) and quantize the
    normalised values, store only which side of each of ``thresholds`` it lies on, or quantize it and store
    that too (``sided``)."""

    kind: str
    reason: str
    min_bits: int = 1
    dims: tuple[int, ...] = ()
    center: bool = True
    groups: int = 0
    thresholds: tuple[float, ...] = ()


# NOTE [ Op rules in compiled graphs ]
# A compiled graph's saved values never reach the eager op rules (``NOTE [ Op rules ]`` in op_rules.py):
# the traced pack sees a fake tensor and, through AOTAutograd's hook context, the forward graph, the
# backward graph and the saved node. Without rules a compiled model lost what they protect: a ViT's
# rows of class tokens under LayerNorm had their rounding error multiplied by the exact rstd, a
# decoder's additive attention mask (zeros and finfo.min) decoded its zeros far from 0 and made the
# gradient NaN, ReLU6 masks flipped (docs/zoo.md, "Under torch.compile"). The rules read the same
# facts the eager ones do, from the graphs:
#   1. a value that depends on no input that receives a gradient (the backward graph returns None for
#      the others) is a constant: an attention mask, a frozen weight's cast, a position table. Eager
#      ``decide`` stores such tensors only losslessly; a traced pack cannot check that, so it keeps them;
#   2. a value the forward feeds to a normalisation (a fused layer, batch or group norm, a ``var_mean``
#      of it, or ``mean(x ** 2)``) is stored normalised with exact statistics, as the eager
#      ``normalization`` rules store it, computed in the graph without data-dependent branches;
#   3. a value the backward reads only through comparisons with constants (ReLU6 / hardtanh, threshold
#      and leaky ReLU backward, an absolute value's ``sgn``, or the ``le`` / ``lt`` / ``ge`` / ``gt`` / ``eq``
#      they decompose to) is stored as which side of each constant it lies on, exactly, and restored as
#      values that compare the same way. A value from which the backward first recomputes what it compares (the
#      partitioner saves a convolution's output and recomputes BatchNorm and the ReLU6 mask from it) is
#      kept: the recomputed value's bounds, in the saved value's units, depend on the norm's statistics
#      and weights, which the pack does not see, and a rounded value near them flips the mask that eager
#      code stores exactly. A value the backward compares and also reads (a leaky ReLU's output that the
#      next convolution saves for its weight's gradient: one saved value serves both, where eager code
#      saves it twice) is quantized and stored with which side of each constant it lies on; each value the
#      rounding carried across is restored next to the constant, on its side (nearer its true value than
#      the rounded one was);
#   4. at least 8 bits where backward exponentiates the value (``NOTE [ Nonlinear backward ]``) and for
#      the q and k of a fused attention backward (the eager ``attention_qk`` rule);
#   5. a normalisation's statistics are kept, as the eager rules keep a norm's mean and rstd: inductor
#      decomposes a norm into ``var_mean`` (or ``mean(x ** 2)``), ``rsqrt`` and elementwise ops, saves
#      the mean and the rstd (reshaped, or divided by the row's length) and recomputes x_hat from them in
#      backward, where rounded statistics shift and scale every value of a row (a batch norm's rstd at
#      2 bits left an offset before it a gradient 5x its input's, which is exactly zero in plain PyTorch);
#   6. a softmax's output (``_softmax``, or inductor's ``exp / sum(exp, dim)``) is restored with rows that
#      sum to 1, a log_softmax's (rule 4) with rows whose ``logsumexp`` is 0, as eager records are (``NOTE
#      [ Probabilities keep their sums ]`` in records.py);
#   7. a value the backward divides by, or feeds to an op singular in it (a log, a square root, digamma, a
#      negative or fractional power, binary cross-entropy's probabilities, a grid sample's grid), directly or
#      through arithmetic that can carry it near the singularity (a shift, a product, a clamp, a view) is kept,
#      as the eager ``singular_backward`` rule keeps it (``NOTE [ Singular backward ]`` in op_rules.py). Through
#      ``exp``, ``sigmoid`` or ``tanh`` an absolute rounding error becomes a bounded relative one, so paths
#      through them are not followed. A decomposition's, inverse's or solve's input and outputs are kept
#      whatever the backward graph does with them (``_linalg_svd``'s backward divides by gaps between singular
#      values through ops the walk does not follow), and so are ``hypot``'s (its backward divides a product of
#      an input and the gradient by its result), a reciprocal's and a product's (``prod``, ``cumprod``, a
#      reduction through an index by ``prod``: their backward multiplies by the result or the other factors, as
#      the eager rule keeps them, instead of dividing). So is a value the forward squares (or passes through a
#      softplus) and feeds, through shifts and sums, to such an op (``sqrt(d ** 2 + eps)``, a Gaussian's learned
#      scale: ``NOTE [ Saves held for a singular backward ]`` in singular.py).
# The auxiliary outputs of multi-output ops (a ``getitem`` past index 0: a norm's mean and rstd,
# attention's logsumexp) are kept, as eager ``decide`` keeps them as constants.
def graph_rule(node: Any, bw_graph: Any, bits: int) -> GraphRule | None:
    """The rule for the saved ``node`` of a forward graph (``None``: quantized at ``bits``)."""
    if _is_auxiliary(node):
        return GraphRule("keep", "auxiliary output")
    if bw_graph is None:
        return None
    uses = _backward_uses(node, bw_graph)
    if not _depends_on_trained_inputs(node, bw_graph):
        return GraphRule("keep", "constant")
    thresholds = _compared_only(uses)
    if thresholds is not None:
        return GraphRule("thresholds", "clip_mask", thresholds=thresholds)
    if _compared_after_recomputing(uses):
        return GraphRule("keep", "recomputed clip mask")
    if _is_statistic(node):
        return GraphRule("keep", "normalization statistic")
    if _singular_use(uses) or _around_kept_op(node) or _squared_before_singular(node):
        return GraphRule("keep", "singular_backward")
    normalized = _normalized(node)
    if normalized is not None:
        return normalized
    dim = _softmax_dim(node)
    if dim is not None:
        return GraphRule("probabilities", "softmax", dims=(dim,))
    if str(node.target) in _LOG_SOFTMAX:
        shape = _shape(node)
        dims = (node.args[1] % len(shape),) if shape and isinstance(node.args[1], int) else ()
        return GraphRule("log_probabilities" if dims else "quantize", "nonlinear backward",
                         min_bits=max(bits, NONLINEAR_MIN_BITS), dims=dims)
    if _exponentiated(uses):
        return GraphRule("quantize", "nonlinear backward", min_bits=max(bits, NONLINEAR_MIN_BITS))
    if any(str(u.target) in _ATTENTION_BACKWARD and _positions(u, p) & {1, 2} for p, u in uses):
        return GraphRule("quantize", "attention_qk", min_bits=max(bits, ATTENTION_MIN_BITS))
    thresholds = _compared_besides(uses)
    if thresholds is not None and _non_negative(node):
        thresholds = tuple(t for t in thresholds if t != 0.0) or None  # 0 is exact in every group of them
    if thresholds is not None:
        return GraphRule("sided", "clip_mask", thresholds=thresholds)
    return None


def _is_auxiliary(node: Any) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int)
            and node.args[1] > 0)


# Ops from a norm's statistics to what the partitioner saves of them: reshapes, an epsilon added, the
# reciprocal square root, a division by the row's length. Each has one tensor operand.
_STATISTIC_PATH = {"aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default", "aten.unsqueeze.default",
                   "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.expand.default",
                   "aten.permute.default", "prims.convert_element_type.default", "aten.clone.default",
                   "aten.alias.default", "aten.add.Tensor", "aten.add.Scalar", "aten.div.Tensor",
                   "aten.div.Scalar", "aten.mul.Tensor", "aten.mul.Scalar", "aten.rsqrt.default",
                   "aten.sqrt.default", "aten.reciprocal.default"}
_ROOTS = {"aten.rsqrt.default", "aten.sqrt.default", "aten.reciprocal.default"}
_STATISTIC_DEPTH = 8


def _is_statistic(node: Any) -> bool:
    """Whether ``node`` is a normalisation's mean or (reciprocal) spread: a ``var_mean`` output, or a root
    of a ``var_mean`` or of a mean of squares, through ``_STATISTIC_PATH`` ops (rule 5)."""
    rooted = False
    for _ in range(_STATISTIC_DEPTH):
        if node.op != "call_function":
            return False
        target = str(node.target)
        if node.target is operator.getitem:
            source = node.args[0]
            return getattr(source, "op", None) == "call_function" and str(source.target).startswith("aten.var_mean")
        if target == "aten.mean.dim":
            squared = node.args[0]
            return rooted and getattr(squared, "op", None) == "call_function" and (
                str(squared.target) == "aten.pow.Tensor_Scalar" and squared.args[1] == 2)
        tensors = node.all_input_nodes
        if target not in _STATISTIC_PATH or len(tensors) != 1:
            return False
        rooted = rooted or target in _ROOTS
        node = tensors[0]
    return False


_SOFTMAX = {"aten._softmax.default", "aten._safe_softmax.default"}


def _softmax_dim(node: Any) -> int | None:
    """The dim (non-negative) ``node`` is a softmax over, if it is one's output (rule 6)."""
    shape = _shape(node)
    if shape is None or node.op != "call_function":
        return None
    dim = None
    if str(node.target) in _SOFTMAX:
        dim = node.args[1]
    elif str(node.target) == "aten.div.Tensor" and len(node.args) == 2:
        numerator, total = node.args
        if (getattr(total, "op", None) == "call_function" and str(total.target) == "aten.sum.dim_IntList"
                and total.args[0] is numerator and len(total.args[1]) == 1
                and (total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False))):
            dim = total.args[1][0]
    if not isinstance(dim, int) or not shape:
        return None
    return dim % len(shape)


def _backward_uses(node: Any, bw_graph: Any) -> list[tuple[Any, Any]]:
    """(placeholder, user) for each use of the saved ``node`` in the backward graph."""
    return [(p, u) for p in bw_graph.find_nodes(op="placeholder") if p.name == node.name for u in p.users]


def _positions(user: Any, arg: Any) -> set[int]:
    return {i for i, a in enumerate(user.args) if a is arg}


def _depends_on_trained_inputs(node: Any, bw_graph: Any) -> bool:
    """Whether ``node`` depends on a forward input that the backward returns a gradient for (rule 1);
    ``True`` where the two graphs do not line up (every input is then taken to be trained)."""
    inputs = node.graph.find_nodes(op="placeholder")
    grads = bw_graph.find_nodes(op="output")[0].args[0]
    if not isinstance(grads, (list, tuple)) or len(grads) != len(inputs):
        return True
    trained = {p for p, g in zip(inputs, grads, strict=True) if g is not None}
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in trained:
            return True
        for m in n.all_input_nodes:
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return False


_COMPARISONS = {"aten.le.Scalar": 1, "aten.lt.Scalar": 1, "aten.ge.Scalar": 1, "aten.gt.Scalar": 1,
                "aten.eq.Scalar": 1}
"""Comparisons of the saved value (argument 0) with a constant (this argument)."""
_SIGNS = {"aten.sgn.default", "aten.sign.default"}
_CLIP_BACKWARDS = {"aten.hardtanh_backward.default": (2, 3), "aten.threshold_backward.default": (2,)}
"""Backward ops that read the saved value (argument 1) only against these constant arguments."""


def _comparison(placeholder: Any, user: Any) -> list[float] | None:
    """The constants ``user`` compares the saved value (``placeholder``) with, if that is all it does with it."""
    target = str(user.target)
    if target in _COMPARISONS and _positions(user, placeholder) == {0}:
        constants = [user.args[_COMPARISONS[target]]]
    elif target in _CLIP_BACKWARDS and _positions(user, placeholder) == {1}:
        constants = [user.args[i] for i in _CLIP_BACKWARDS[target]]
    elif target == "aten.leaky_relu_backward.default" and _positions(user, placeholder) == {1}:
        constants = [0.0]  # the sign picks 1 or the slope, on the input or on a non-negative slope's output
    elif target in _SIGNS and _positions(user, placeholder) == {0}:
        constants = [0.0]  # an absolute value's backward: 1, -1, or 0 at 0
    else:
        return None
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in constants):
        return None
    return [float(c) for c in constants]


def _compared_only(uses: list[tuple[Any, Any]]) -> tuple[float, ...] | None:
    """The sorted constants the backward compares the saved value with, if that is all it reads (rule 3)."""
    found: set[float] = set()
    for placeholder, user in uses:
        constants = _comparison(placeholder, user)
        if constants is None:
            return None
        found.update(constants)
    return tuple(sorted(found)) if uses and found else None


# Ops whose output is >= 0 when their argument at the given position (a lower bound) is: a group of such
# values whose min is 0 is stored zero-exact, a group without 0 above 0 (``layout.py``), so comparisons
# with 0 survive rounding.
_NON_NEGATIVE = {"aten.relu.default": None, "aten.hardtanh.default": 1, "aten.clamp_min.default": 1,
                 "aten.clamp.default": 1}


def _non_negative(node: Any) -> bool:
    """Whether ``node`` of a forward graph is a ReLU's output (or a clamp's at 0 or above), through views."""
    for _ in range(_PASS_ON_DEPTH + 1):
        target = str(node.target) if node.op == "call_function" else ""
        if target in _NON_NEGATIVE:
            position = _NON_NEGATIVE[target]
            if position is None:
                return True
            bound = node.args[position] if len(node.args) > position else None
            return isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound >= 0
        if target not in _VIEWS or not node.args:
            return False
        node = node.args[0]
    return False


def _compared_besides(uses: list[tuple[Any, Any]]) -> tuple[float, ...] | None:
    """The sorted constants the backward compares the saved value with, directly or through views (a
    ``detach``), where it also reads its values (rule 3: a leaky ReLU's output that the next layer saves too)."""
    found: set[float] = set()
    frontier = list(uses)
    for _ in range(_PASS_ON_DEPTH + 1):
        through_views = []
        for placeholder, user in frontier:
            constants = _comparison(placeholder, user)
            if constants is not None:
                found.update(constants)
            elif str(user.target) in _VIEWS and _positions(user, placeholder) == {0}:
                through_views.extend((user, u) for u in user.users)
        frontier = through_views
    return tuple(sorted(found)) if found else None


# Elementwise ops through which the backward recomputes a forward value from a saved one, with operands
# that do not depend on the incoming gradients (a norm's statistics, its weight and bias, constants).
_RECOMPUTE = {"aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.add.Scalar",
              "aten.sub.Scalar", "aten.mul.Scalar", "aten.div.Scalar", "aten.neg.default",
              "prims.convert_element_type.default", "aten.clone.default", "aten.view.default",
              "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
              "aten.expand.default", "aten.permute.default"}
_RECOMPUTE_DEPTH = 6


def _compared_after_recomputing(uses: list[tuple[Any, Any]]) -> bool:
    """Whether the backward compares with a constant a value it recomputes from the saved one and other
    values of the graph (rule 3). Through Python scalars alone (softplus's ``beta * x > threshold``) the
    bound is a constant in the saved value's own units, as in eager code, and does not count."""
    from_gradients: dict[Any, bool] = {}
    frontier = [(p, u, False) for p, u in uses if str(u.target) in _RECOMPUTE]
    seen = {u for _, u, _ in frontier}
    for _ in range(_RECOMPUTE_DEPTH):
        recomputed = []
        for value, user, mixed in frontier:
            others = [a for a in user.all_input_nodes if a is not value]
            if not any(_from_gradients(a, from_gradients) for a in others):
                recomputed.append((user, mixed or bool(others)))
        if any(mixed and _compared_only([(r, u)]) is not None for r, mixed in recomputed for u in r.users):
            return True
        frontier = [(r, u, mixed) for r, mixed in recomputed for u in r.users
                    if str(u.target) in _RECOMPUTE and u not in seen]
        seen.update(u for _, u, _ in frontier)
    return False


def is_incoming_gradient(node: Any) -> bool:
    """Whether ``node`` is an input of a backward graph that carries an output's gradient
    (AOTAutograd names them ``tangents_*``)."""
    return node.op == "placeholder" and node.name.startswith("tangents")


def _from_gradients(node: Any, memo: dict[Any, bool]) -> bool:
    """Whether ``node`` of a backward graph depends on one of its incoming gradients (``tangents_*``)."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        if n.op == "placeholder":
            memo[n] = is_incoming_gradient(n)
            stack.pop()
            continue
        pending = [m for m in n.all_input_nodes if m not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[n] = any(memo[m] for m in n.all_input_nodes)
        stack.pop()
    return memo[node]


_BATCH_NORMS = {"aten.native_batch_norm.default": 5, "aten._native_batch_norm_legit_functional.default": 5,
                "aten._native_batch_norm_legit.default": 5, "aten._native_batch_norm_legit.no_stats": 3}
"""Batch norms and the position of their ``training`` argument."""


# Ops through which the forward may pass a saved value on to a normalisation: a position embedding
# added to the patch tokens before the first LayerNorm, a layer scale and a residual sum before the
# next (the partitioner then saves the parts and recomputes the norm's input from them in backward).
# Normalised over the same rows, a part's error stays a fraction of its own rows' spread, as the eager
# rule keeps the norm input's (where the parts nearly cancel the sum's spread is smaller than theirs).
_PASS_ON = {"aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "prims.convert_element_type.default",
            "aten.clone.default", "aten.alias.default", "aten.view.default", "aten._unsafe_view.default",
            "aten.reshape.default"}
_PASS_ON_DEPTH = 3


def _shape(node: Any) -> tuple[int, ...] | None:
    shape = getattr(node.meta.get("val"), "shape", None)
    return tuple(shape) if shape is not None else None


def _normalized(node: Any) -> GraphRule | None:
    """The normalisation the forward feeds ``node`` to, directly or through ``_PASS_ON`` ops, if its
    statistics are over the same values of ``node`` (its shape's, or trailing dims of the same sizes'
    product), if any (rule 2)."""
    shape = _shape(node)
    if shape is None:
        return None
    frontier, seen = [node], {node}
    for _ in range(_PASS_ON_DEPTH + 1):
        for value in frontier:
            found = _shape(value)
            rule = _normalizing_user(value, len(found)) if found is not None else None
            if rule is not None and found is not None:
                mapped = _same_rows(rule, found, shape)
                if mapped is not None:
                    return mapped
        frontier = [u for v in frontier for u in v.users if str(u.target) in _PASS_ON and u not in seen]
        seen.update(frontier)
    return None


def _same_rows(rule: GraphRule, found: tuple[int, ...], shape: tuple[int, ...]) -> GraphRule | None:
    """``rule``, made for a value of shape ``found``, for the saved value of ``shape`` it passed on from."""
    if found == shape:
        return rule
    rank = len(found)
    if rule.groups or rule.dims != tuple(range(rank - len(rule.dims), rank)):
        return None
    size, count = 1, 0
    for dim in rule.dims:
        size *= found[dim]
    product = 1
    while product < size and count < len(shape):
        count += 1
        product *= shape[-count]
    if product != size:
        return None
    return dataclasses.replace(rule, dims=tuple(range(len(shape) - count, len(shape))))


def _normalizing_user(node: Any, rank: int) -> GraphRule | None:
    for user in node.users:
        if _positions(user, node) != {0}:
            continue
        target, args = str(user.target), user.args
        if target == "aten.native_layer_norm.default":
            return GraphRule("normalize", "normalization", dims=tuple(range(rank - len(args[1]), rank)))
        if target in _BATCH_NORMS and len(args) > _BATCH_NORMS[target] and args[_BATCH_NORMS[target]] is True:
            return GraphRule("normalize", "normalization", dims=(0, *range(2, rank)))
        if target == "aten.native_group_norm.default" and isinstance(args[6], int):
            return GraphRule("normalize", "normalization", dims=(2,), groups=args[6])
        if target == "aten.var_mean.correction" and user.kwargs.get("correction", 1) == 0:
            dims = args[1] if len(args) > 1 else None
            if isinstance(dims, (list, tuple)) and dims:
                return GraphRule("normalize", "normalization", dims=tuple(sorted(d % rank for d in dims)))
        if target == "aten.pow.Tensor_Scalar" and args[1] == 2:
            for mean in user.users:
                if (str(mean.target) == "aten.mean.dim" and mean.args[0] is user and len(mean.args) > 2
                        and mean.args[2] is True):
                    dims = tuple(sorted(d % rank for d in mean.args[1]))
                    return GraphRule("normalize", "decomposed_rms_norm", dims=dims, center=False)
    return None


_LOG_SOFTMAX = {"aten._log_softmax.default"}
_EXP_OF_SAVED = {"aten.exp.default", "aten._log_softmax_backward_data.default"}
# Ops that pass a saved tensor's rounding error on unchanged (up to a shift or a cast) on its way to an
# ``exp``: a decomposed log_softmax backward computes ``exp(logits - amax - logsumexp)`` from saved logits.
_SHIFTS = {"aten.sub.Tensor", "aten.sub.Scalar", "aten.add.Tensor", "aten.add.Scalar", "aten.neg.default",
           "prims.convert_element_type.default", "aten.view.default", "aten._unsafe_view.default",
           "aten.reshape.default", "aten.expand.default", "aten.clone.default"}
_SHIFT_DEPTH = 4
_ATTENTION_BACKWARD = {"aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                       "aten._scaled_dot_product_flash_attention_backward.default",
                       "aten._scaled_dot_product_efficient_attention_backward.default",
                       "aten._scaled_dot_product_cudnn_attention_backward.default"}


def _exponentiated(uses: list[tuple[Any, Any]]) -> bool:
    users = [u for _, u in uses]
    for _ in range(_SHIFT_DEPTH):
        if any(str(u.target) in _EXP_OF_SAVED for u in users):
            return True
        users = [v for u in users if str(u.target) in _SHIFTS for v in u.users]
    return False


# Rule 7: backward ops singular in an argument (its positions; a segment reduction's backward, which compares its
# input with its result, among them), and the ops a saved value's rounding error passes through on its way there
# unchanged or scaled (``NOTE [ Op rules in compiled graphs ]``).
_SINGULAR_AT = {"aten.div.Tensor": {1}, "aten.reciprocal.default": {0}, "aten.log.default": {0},
                "aten.log1p.default": {0}, "aten.log2.default": {0}, "aten.log10.default": {0},
                "aten.sqrt.default": {0}, "aten.rsqrt.default": {0}, "aten.digamma.default": {0},
                "aten.lgamma.default": {0}, "aten.polygamma.default": {1}, "aten.xlogy.Tensor": {1},
                "aten.atan2.default": {0, 1}, "aten.binary_cross_entropy_backward.default": {1},
                "aten.grid_sampler_2d_backward.default": {2}, "aten.grid_sampler_3d_backward.default": {2},
                "aten._cdist_backward.default": {1, 2, 4}, "aten._segment_reduce_backward.default": {1, 2},
                "aten.logit_backward.default": {1}}
# Views, copies and casts of a value (rule 7's walks between a saved value and a decomposition).
_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
          "aten.transpose.int", "aten.t.default", "aten.expand.default", "aten.clone.default", "aten.alias.default",
          "aten.unsqueeze.default", "aten.squeeze.dim", "prims.convert_element_type.default", "aten.detach.default"}
_PASS_THROUGH = _SHIFTS | _VIEWS | {"aten.mul.Tensor", "aten.mul.Scalar", "aten.pow.Tensor_Scalar",
                                    "aten.rsub.Scalar", "aten.rsub.Tensor", "aten.abs.default", "aten.clamp.default",
                                    "aten.clamp_min.default", "aten.clamp_max.default", "aten.slice.Tensor",
                                    "aten.select.int"}
_SINGULAR_DEPTH = 6


def _singular_in(user: Any, target: str, positions: set[int]) -> bool:
    """Whether ``user`` (an op named ``target``) is singular in its arguments at ``positions`` (rule 7): one of
    ``_SINGULAR_AT``, or a negative or fractional power of its base."""
    if positions & _SINGULAR_AT.get(target, set()):
        return True
    if target == "aten.pow.Tensor_Scalar" and positions == {0}:
        exponent = user.args[1]
        return isinstance(exponent, (int, float)) and (exponent < 0 or 0 < exponent < 1)
    return False


def _singular_use(uses: list[tuple[Any, Any]]) -> bool:
    """Whether the backward divides by the saved value or feeds it to an op singular in it (rule 7)."""
    frontier, seen = list(uses), set()
    for _ in range(_SINGULAR_DEPTH):
        following = []
        for arg, user in frontier:
            target = str(user.target)
            if _singular_in(user, target, _positions(user, arg)):
                return True
            if target in _PASS_THROUGH and user not in seen:
                seen.add(user)
                following += [(user, u) for u in user.users]
        frontier = following
    return False


_SQUARED_DEPTH = 10
"""Ops from a saved value to a singular op through a square: views and slices of an image, a difference, the square,
sums and an epsilon (a total-variation penalty)."""
_SCALINGS = {"aten.mul.Scalar", "aten.div.Scalar", "aten.neg.default"} | _VIEWS
"""Ops from a value to what the partitioner saves of it for a square's backward (``2 * x ** 1``)."""


def _squared_before_singular(node: Any) -> bool:
    """Whether the forward squares ``node``, or the value it scales or views (the partitioner saves ``2 * x`` for
    ``x ** 2``'s backward), and feeds the square, through shifts, sums and products, to an op singular in it
    (rule 7)."""
    source = node
    for _ in range(_VIEW_DEPTH):
        if _squared_into_singular(source):
            return True
        scaling = getattr(source, "op", None) == "call_function" and (str(source.target) in _SCALINGS or (
            str(source.target) == "aten.pow.Tensor_Scalar" and source.args[1] == 1))  # ``x ** 1`` of pow's backward
        if not (scaling and source.args and hasattr(source.args[0], "users")):
            return False
        source = source.args[0]
    return False


def _sums_few_terms(node: Any) -> bool:
    """Whether ``node`` sums (or averages) at most ``FEW_TERMS`` values along its dims into each result (a 2-D or 3-D
    vector's squared length)."""
    if str(node.target) not in ("aten.sum.dim_IntList", "aten.mean.dim") or len(node.args) < 2:
        return False
    value = getattr(node.args[0], "meta", {}).get("val")
    dims = node.args[1]
    if value is None or not isinstance(dims, (list, tuple)) or not dims:
        return False
    return sums_few_terms(value.shape, dims)


def _squared_into_singular(node: Any) -> bool:
    """Whether the forward squares ``node`` (``x * x``, ``x ** 2``) or passes it through a softplus, after shifts,
    slices and products, and feeds the result, through them, sums (of a few terms along a dim too) and divisions by
    constants, to an op singular in it."""
    frontier, seen = [(node, False)], set()
    for _ in range(_SQUARED_DEPTH):
        following = []
        for value, squared in frontier:
            for user in value.users:
                target, positions = str(user.target), _positions(user, value)
                if squared and _singular_in(user, target, positions):
                    return True
                square = (target == "aten.mul.Tensor" and positions == {0, 1}) or (
                    target == "aten.pow.Tensor_Scalar" and positions == {0} and user.args[1] == 2) or (
                    target == "aten.softplus.default" and positions == {0})
                follows = square or target in _PASS_THROUGH or target == "aten.div.Scalar" or (
                    target == "aten.div.Tensor" and positions == {0}) or (squared and _sums_few_terms(user))
                if follows and (user, squared or square) not in seen:
                    seen.add((user, squared or square))
                    following.append((user, squared or square))
        frontier = following
    return False


# Prefixes of their op names; a whole name ends in its overload (``aten.det.default``: not ``aten.detach``).
_KEPT_AROUND = ("aten._linalg_", "aten.linalg_", "aten.cholesky", "aten.triangular_solve.", "aten.lu_",
                "aten.ormqr.", "aten.orgqr.", "aten.geqrf.", "aten.logdet.", "aten.det.", "aten.hypot.",
                "aten.reciprocal.", "aten.prod.", "aten.cumprod.")
"""Ops whose inputs and outputs rule 7 keeps whatever the backward graph does with them: decompositions, inverses
and solves, ``hypot`` (its backward divides a product of an input and the gradient by the result), ``reciprocal``
(its backward multiplies the gradient by the result squared, which the eager rule keeps: ``1 / (1 + x ** 2)``'s,
rounded, was off most where its gradient is largest), and products (their backward multiplies the other factors,
whose relative errors are unbounded near 0; reductions through an index by ``prod`` among them)."""
_BY_INDEX = frozenset({"aten.scatter_reduce.two", "aten.index_reduce.default"})


def _kept_op(node: Any) -> bool:
    """Whether ``node`` calls one of ``_KEPT_AROUND``'s ops, or reduces through an index by a product."""
    if getattr(node, "op", None) != "call_function":
        return False
    target = str(node.target)
    return target.startswith(_KEPT_AROUND) or (target in _BY_INDEX and "prod" in node.args)


def _around_kept_op(node: Any) -> bool:
    """Whether ``node`` is an output of one of ``_KEPT_AROUND``'s ops or an input of one, or a view of either (rule
    7)."""
    source = node
    for _ in range(_VIEW_DEPTH):  # an output, or a view or copy of one
        if getattr(source, "op", None) != "call_function":
            break
        if _kept_op(source):
            return True
        if source.target is not operator.getitem and str(source.target) not in _VIEWS:
            break
        source = source.args[0]
    users = list(node.users)
    for _ in range(_VIEW_DEPTH):  # the input itself, or a view or copy of it
        if any(_kept_op(u) for u in users):
            return True
        users = [v for u in users if str(u.target) in _VIEWS for v in u.users]
    return False


_VIEW_DEPTH = 8
