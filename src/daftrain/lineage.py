"""Whether a saved tensor is a copy an op made of one of its operands.

An op does not always save the tensor it was given: under autocast it saves the operand cast to the
autocast dtype, and ``F.linear`` / ``matmul`` save a contiguous copy of a transposed operand. The op
rules and the importance tracer, which recognise an operand among the tensors a call saves, accept
such copies (``NOTE [ Copies an op saves ]``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CAST_AND_VIEW_NODES", "copy_of", "reaches", "signed"]

# Single-input autograd nodes that only cast or re-view a tensor (autocast saves ``weight.to(bf16).t()``).
CAST_AND_VIEW_NODES = frozenset(
    {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
     "ReshapeAliasBackward0", "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0", "UnsqueezeBackward0",
     "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2"}
)
_CAST_NODES = frozenset({"ToCopyBackward0", "CloneBackward0"})
_COPY_NODES = CAST_AND_VIEW_NODES | _CAST_NODES
_RESHAPE_NODES = _CAST_NODES | {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"}
_MAX_STEPS = 5


def signed(value: int) -> int:
    """An int64 an autograd node's ``_saved_*`` attribute read back as unsigned (a negative dim), signed again."""
    return value - (1 << 64) if value >= 1 << 63 else value


def reaches(node: object, end: Callable[[object], bool], through: frozenset[str], max_steps: int) -> bool:
    """Whether walking back from the autograd ``node``, through single-input nodes whose class is named in
    ``through``, reaches a node ``end`` accepts within ``max_steps`` steps."""
    return reached(node, end, through, max_steps) is not None


def reached(node: object, end: Callable[[object], bool], through: frozenset[str], max_steps: int) -> object | None:
    """The node ``reaches`` finds, or ``None``."""
    for _ in range(max_steps + 1):
        if node is None:
            return None
        if end(node):
            return node
        if type(node).__name__ not in through:
            return None
        inputs = [fn for fn, _ in node.next_functions if fn is not None]  # type: ignore[attr-defined]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


# NOTE [ Copies an op saves ]
# ``saved`` counts as a copy of ``source`` when both hold the same number of values and either
#   1. ``saved``'s grad_fn chain reaches ``source``'s grad_fn through casts, clones and views only
#      (single-input nodes: the values are ``source``'s, possibly cast and laid out anew), or
#   2. neither tracks a gradient (a model input, a frozen embedding's output) and ``saved`` is
#      contiguous or shaped like ``source``, in another dtype or ``source`` is not contiguous: no graph
#      to follow, and inside one op call no other saved tensor of that size arises from the operand.
# With ``same_shape`` the copy must also have ``source``'s shape and the chain holds casts and clones
# only: an encoding planned on the rows of ``source`` then reads the same rows in the copy (a square
# matrix transposed and copied would have the shape and other rows). With ``same_order`` the copy is
# contiguous and the chain holds casts, clones and reshapes only: its memory holds ``source``'s values
# in ``source``'s logical order (``instance_norm`` of a channels_last input saves such a reshaped copy).
def copy_of(saved: torch.Tensor, source: object, same_shape: bool = False, same_order: bool = False) -> bool:
    """``saved`` is a cast, clone or view of ``source`` an op made (``NOTE [ Copies an op saves ]``)."""
    if not isinstance(source, torch.Tensor) or saved.numel() != source.numel():
        return False
    if same_shape and saved.shape != source.shape:
        return False
    target = source.grad_fn
    if same_order:
        return (saved.is_contiguous() and target is not None
                and reaches(saved.grad_fn, lambda node: node is target, _RESHAPE_NODES, _MAX_STEPS))
    if target is None:
        if saved.grad_fn is not None or source.requires_grad:
            return False
        relaid = saved.is_contiguous() or saved.shape == source.shape
        return relaid and (saved.dtype != source.dtype or not source.is_contiguous())
    through = _CAST_NODES if same_shape else _COPY_NODES
    return reaches(saved.grad_fn, lambda node: node is target, through, _MAX_STEPS)
