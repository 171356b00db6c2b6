"""What the ``singular_backward`` rule's saves need beyond the rule: the saves a kept value was shifted from, and
the warning where a decomposition reads a product of rounded tensors (``NOTE [ Every save of a value a singular
backward reads ]`` in ``hooks.py``, ``NOTE [ Products before a singular backward ]``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..lineage import CAST_AND_VIEW_NODES, reached, signed

__all__ = [
    "HELD_PRODUCERS",
    "HELD_SAVES",
    "RECENT_SAVES",
    "RECENT_SAVE_BYTES",
    "SHIFTS",
    "SINGULAR_RESULTS",
    "after_product",
    "caller_level",
    "held_inputs",
    "sums_few_terms",
]

# Saved outputs held for the values shifted from them: the latest ``RECENT_SAVES`` of these ops, of at most
# ``RECENT_SAVE_BYTES`` each.
RECENT_SAVES = 4
RECENT_SAVE_BYTES = 4 << 20
HELD_PRODUCERS = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0", "SigmoidBackward0", "ExpBackward0",
                            "TanhBackward0"})
# Nodes of singular ops that save their result: a kept result is read with the saves of its one input (a
# sigmoid's output before ``ndtri``: ``exp(y**2 / 2)`` times the sigmoid's ``p (1 - p)``, which cancel).
SINGULAR_RESULTS = frozenset({"SpecialNdtriBackward0", "TanBackward0", "SqrtBackward0", "ReciprocalBackward0",
                              "RsqrtBackward0", "ErfinvBackward0"})
# Nodes of a value made from one other by constants.
SHIFTS = CAST_AND_VIEW_NODES | {"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0",
                                "RsubBackward1", "NegBackward0", "MulBackward0", "MulBackward1", "DivBackward0",
                                "DivBackward1", "ClampMinBackward0", "ClampBackward1", "CloneBackward0"}


# NOTE [ Products before a singular backward ]
# The ``singular_backward`` rule keeps what an inverse, a decomposition or a division reads, and the save it was
# shifted from (``NOTE [ Every save of a value a singular backward reads ]`` in hooks.py), but not the operands of a
# product made before it: for ``S = m @ m.T + eps * I`` then ``cholesky(S)`` the matmul saves ``m`` rounded, and
# the gradient ``(G + G.T) m`` carries that rounding times ``G ~ inverse(S)``, unbounded as S nears singular (a
# Cholesky factor's log-diagonal: 0.88 at 8 bits, ``benchmarks/bench_losses.py``). Their values are gone by the
# time the kept one is saved, so the context says so once, where the value a decomposition, an inverse or a solve
# keeps is, through shifts and views, a product of two tensors that both carry a gradient from the graph (not a
# layer's activation times its weight, whose backward reads the weight exact). An elementwise division by such a
# product (``a / (h * h + 1)``) is not warned of: its divisor is rarely near 0, and nothing in the graph says
# when it is.
_PRODUCTS = frozenset({"MmBackward0", "BmmBackward0", "MulBackward0", "MvBackward0", "DotBackward0",
                       "BaddbmmBackward0", "AddmmBackward0", "AddbmmBackward0"})


_LIBRARIES = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))


def caller_level() -> int:
    """The ``stacklevel`` of a warning raised in a pack hook that names the first frame outside daftrain and torch:
    the user's call that saved the tensor."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def after_product(node: Any) -> bool:
    """Whether the kept value of ``node`` is, through shifts and views, a product of two computed tensors; where
    ``node`` is neither (the decomposition's own node, for a saved output), whether one of its inputs is."""
    if node is None:
        return False
    name = type(node).__name__
    starts = [node] if name in SHIFTS or name in _PRODUCTS else [fn for fn, _ in node.next_functions if fn is not None]
    return any(reached(n, _product_of_activations, SHIFTS, len(SHIFTS)) is not None for n in starts)


def _product_of_activations(node: Any) -> bool:
    if type(node).__name__ not in _PRODUCTS:
        return False
    return sum(1 for fn, _ in node.next_functions if fn is not None and _computed(fn)) >= 2


def _computed(node: Any) -> bool:
    """An input made in the graph: not a leaf (a weight) nor a view or cast of one (a linear layer's weight.T)."""
    return reached(node, lambda n: type(n).__name__ == "AccumulateGrad", CAST_AND_VIEW_NODES, 4) is None


# NOTE [ Saves held for a singular backward ]
# ``sqrt(d ** 2 + eps)`` (a Charbonnier loss, a smooth L1 or total-variation penalty), ``log(d ** 2 + eps)`` and
# ``1 / (1 + d ** 2)`` keep what their singular op saves exact, but the square before it saves ``d``, and its
# backward multiplies ``d``'s rounding error by the gradient arriving from that op: ``e / sqrt(d**2 + eps)`` for the
# root, largest exactly where ``d`` is near 0 and its error is largest against it: more bits do not bound it
# (``docs/saved.md``, "Singular backward"). A softplus likewise: a learned scale ``softplus(s) + eps`` is divided by
# (a Gaussian's ``1 / var``) where it is small, which is where its derivative, ``sigmoid(s)``, is ``exp(s)``, and a
# rounded ``s`` scales that gradient by ``exp(e)``. The square or softplus comes first, so what it saves is held: the
# tensors such a call saves (``x * x``, ``x ** 2``, ``square``, ``softplus``; ``OpMatch.held``) stay referenced for
# the next ``HELD_SAVES`` saves of the forward, and a value the rule keeps exact whose graph reaches such a call
# through shifts, sums of terms (or of at most ``FEW_TERMS`` values along a dim: a 2-D flow's end-point error written
# out) and the singular op that made it (``sqrt(dx ** 2 + dy ** 2 + eps)``) makes that call's record exact. One no
# such op reads within those saves (a squared ReLU, a variance, Mamba's step size) stays rounded, its tensor
# released: what the holding costs is that tensor a few saves longer.
HELD_SAVES = 4
_HELD_THROUGH = SHIFTS | SINGULAR_RESULTS | {"PowBackward0", "SoftplusBackward0"}
_HELD_NODES = 16
"""Nodes the walk from a kept value visits at most."""
FEW_TERMS = 4
"""A sum of at most this many squares (a 2-D or 3-D vector's length, ``sqrt((d ** 2).sum(1) + eps)``) is small
wherever its terms are, and is walked through; a longer row's is an RMSNorm written out, whose input the
``decomposed_rms_norm`` rule stores normalised per row."""
_SUMS = frozenset({"SumBackward1", "MeanBackward1"})


def sums_few_terms(sizes: Sequence[Any], dims: Sequence[int]) -> bool:
    """Whether reducing a tensor of ``sizes`` along ``dims`` sums at most ``FEW_TERMS`` values into each result (a
    dim read back from an autograd node as unsigned is signed again)."""
    count = 1
    for dim in dims:
        count *= sizes[signed(dim) % max(1, len(sizes))]
    return isinstance(count, int) and count <= FEW_TERMS


def held_inputs(node: Any, producers: set[Any]) -> set[Any]:
    """The nodes among ``producers`` that walking back from ``node`` reaches through shifts, sums of terms,
    singular ops that save their result, squares and softplus (``NOTE [ Saves held for a singular backward ]``)."""
    found: set[Any] = set()
    seen: set[Any] = set()
    frontier = [node]
    while frontier and len(seen) < _HELD_NODES:
        current = frontier.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        if current in producers:
            found.add(current)
        name = type(current).__name__
        if name in _HELD_THROUGH or (name in _SUMS and sums_few_terms(current._saved_self_sym_sizes,
                                                                     current._saved_dim)):
            frontier.extend(fn for fn, _ in current.next_functions)
    return found
