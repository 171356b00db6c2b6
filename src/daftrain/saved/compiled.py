"""``compress`` under ``torch.compile``: saved-tensor hooks that AOTAutograd inlines into compiled graphs.

The two hooks a ``compress`` context pushes are ``_Hook`` objects: ``torch.fx.GraphModule`` subclasses,
one shared pair per traceable configuration (``hooks_for``). Called on real tensors (eager code, graph
breaks) they run the context's eager pack and unpack; traced by AOTAutograd (fake tensors) they run
``pack_traced`` / ``unpack_traced``, which AOTAutograd inlines at the end of the compiled forward and the
start of the compiled backward. See ``NOTE [ Hooks inside compiled graphs ]``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import struct
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..callbacks import eagerly, never_a_frame, skip_frames
from ..config import CompressionConfig
from ..errors import UnsupportedError
from ..layout import GRID_BITS, QUANTIZABLE_DTYPES, PackedLayout, bool_nbytes, record_seed
from .graph_order import install_decode_order
from .graph_rules import GraphRule, graph_rule
from .records import KeptTensor, normalized_over, restandardized, with_row_sums

__all__ = ["CompileFallbackWarning", "CompiledHooks", "hooks_for", "pack_traced", "unpack_traced",
           "untraceable_reason"]


class CompileFallbackWarning(UserWarning):
    """A ``compress`` context whose settings cannot run inside a compiled graph (``bits="auto"``, a
    ``PagePool``, asynchronous packing) had a graph compiled under it: that graph's saved tensors are
    stored exact; eager code and graph breaks are still compressed."""


# NOTE [ Hooks inside compiled graphs ]
# AOTAutograd inlines saved-tensor hooks into the graphs it compiles when both hooks on top of the
# stack are ``torch.fx.GraphModule``s: it calls the pack hook on the fake value of each saved
# intermediate (inputs and parameters are not offered: ``saved_tensors_hooks_filtering_mode``
# "donated"), retraces it with make_fx, appends that graph to the forward and the unpack hook's graph
# to the backward, and disables the hooks while the compiled function runs. Python hooks would instead
# see the compiled function's saved tensors at run time, detached: ``decide`` took them for constants
# and kept them, so nothing in a compiled region was compressed. Hence:
#   1. ``_Hook.__call__`` dispatches: fake or traced tensors go to ``pack_traced`` / ``unpack_traced``
#      (fixed bits only, pure functions of the tensor and constant settings); real tensors go to the
#      active context's eager ``_pack`` / ``_unpack``, whatever its settings.
#   2. Dynamo guards a compiled graph on the ids of the hooks on the stack: hooks made per context
#      would recompile every graph for every new context (``with daftrain.compress(bits=2):`` in the
#      loop) until the recompile limit. So one pair per configuration serves every context
#      (``hooks_for``); a pair finds the context that runs an eager pack on its per-thread stack of
#      entered contexts, and eager handles carry their context to the unpack (``_Owned``), so the
#      context lives exactly as long as its graph's saved tensors (``NOTE [ No reference cycle ]``
#      in hooks.py).
#   3. Dynamo rebuilds the hooks as ``GraphModule(root, hook.graph)`` for its cache checks, so each
#      graph is self-contained: one call of a module-level ``torch.fx.wrap``'d function with constant
#      arguments.
#   4. Settings that cannot be traced (``bits="auto"``: its allocation is decided at run time from
#      observed tensors; a pool: host pages; asynchronous packing: a thread) share one pair whose
#      traced path is the identity: such a context warns once (``CompileFallbackWarning``) when a graph
#      is compiled under it, and its eager regions are compressed as before. The alternative, packing
#      compiled graphs at fixed bits anyway, would silently change what those settings promise.
#
# NOTE [ What the traced pack decides ]
# The traced pack sees a fake tensor and the saved node of the forward and backward graphs
# (``_get_saved_tensor_hook_context``), not a grad_fn, so it decides from those:
#   * kept: non-strided tensors, non-contiguous ones other than permutations of a contiguous one
#     (``NOTE [ Permuted memory formats in compiled graphs ]``), fewer than ``min_numel`` values,
#     integer and other dtypes, ``bits=None``;
#   * bool tensors bit-packed;
#   * float tensors as the graph's op rules say (``NOTE [ Op rules in compiled graphs ]`` in
#     graph_rules.py: constants and auxiliary outputs kept, normalisation inputs normalised, clip
#     inputs as the sides of their bounds, at least ``NONLINEAR_MIN_BITS`` where backward exponentiates),
#     the rest quantized at the configured bits.

# NOTE [ A fresh seed per compiled call ]
# An ``int`` seed would be a constant of the compiled graph: every step would round with the same noise, and the
# rounding errors of successive steps would add up instead of averaging out. So the traced pack draws each record's
# seed inside the graph and passes it to ``quantize_pack_seeded`` as a tensor. It drew it with ``torch.randint`` from
# torch's own generator, which moved every random draw of the user's after it: under ``torch.compile`` a model's
# dropout masks, a Gumbel-softmax's or a reparameterised sample's noise, a DataLoader's shuffling all changed with
# compression (against plain compiled PyTorch on the same seeds: ``bench_setups.py --compile``), where eager code draws
# nothing from it. ``daftrain::seed_in_graph`` asks the context that runs the graph instead, which hashes its seed
# (``config.seed``, else ``torch.initial_seed()`` when it was made), its step and a count of the step's compiled
# records, as it seeds its eager records: a new context on the same seed rounds alike. The op is tagged
# ``nondeterministic_seeded``, as torch's random ops are, so that AOTAutograd neither merges two of its calls nor
# recomputes one in backward; it reads the tensor it seeds, so that no compiler takes it for a constant.


@never_a_frame  # the saved-tensor hooks call it first (NOTE [ Callbacks in a compiled function's eager code ])
def is_traced(value: Any) -> bool:
    """True when ``value`` (a tensor, or what a pack hook returned) is being traced, not computed."""
    if isinstance(value, tuple):
        value = value[0]
    if not torch._C._len_torch_dispatch_stack() and type(value) in _PLAIN:  # no dispatch mode, no tensor subclass
        return False
    return (isinstance(value, FakeTensor | FunctionalTensor)
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


def _saved_node() -> tuple[Any, Any] | None:
    """The saved node being packed and the backward graph, while AOTAutograd inlines the hooks."""
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context

    state = _get_saved_tensor_hook_context()
    if not state:
        return None
    return state.get("_node"), state.get("_bw_graph")


# NOTE [ Permuted memory formats in compiled graphs ]
# A CNN trained in channels_last (with torch.compile, the usual recipe for speed) saves 4-D and 5-D
# activations whose memory holds (N, H, W, C); attention saves q, k and v as (B, H, T, D) views of
# (B, T, H, D) memory, and a linear layer the transpose of its input for the weight gradient. The traced
# pack stores such a tensor as its memory, in memory order (``x.permute`` to that order is contiguous
# and costs nothing), with the permutation back as a constant of the graph; the unpack restores the
# same strides as a permuted view, as the eager path does with any dense view (``NOTE [ One record per
# storage span ]`` in hooks.py). Kept, such a view also kept alive the storage of its base, which the
# graph may save (and quantize) as well. The permutation of a permuted memory format is read from the
# format, which Dynamo guards on; any other from sorting the strides, where the sizes and strides are
# static: under dynamic shapes sorting them would guard on every size, so such tensors are kept there.
_PERMUTED_FORMATS = ((torch.channels_last, (0, 2, 3, 1)), (torch.channels_last_3d, (0, 2, 3, 4, 1)))


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """``x``'s dims in memory order: ``()`` where ``x`` is contiguous, the permutation where it is a
    permutation of a contiguous tensor, ``None`` otherwise (``NOTE [ Permuted memory formats in compiled
    graphs ]``)."""
    if x.is_contiguous():
        return ()
    for memory_format, order in _PERMUTED_FORMATS:
        if x.dim() == len(order) and x.is_contiguous(memory_format=memory_format):
            return order
    if any(isinstance(n, torch.SymInt) for n in (*x.shape, *x.stride())):
        return None
    order = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), d)))
    return order if x.permute(order).is_contiguous() else None


_KEEP = GraphRule("keep", "")
_BOOL = GraphRule("bool", "")


def traced_treatment(x: torch.Tensor, bits: int | None, min_numel: int, pack_bool: bool) -> GraphRule:
    """How the traced pack stores ``x``; see ``NOTE [ What the traced pack decides ]``."""
    if x.layout != torch.strided or x.numel() == 0 or x.numel() < min_numel or memory_order(x) is None:
        return _KEEP
    if x.dtype == torch.bool:
        return _BOOL if pack_bool else _KEEP
    if bits is None or x.dtype not in QUANTIZABLE_DTYPES:
        return _KEEP
    saved = _saved_node()
    rule = graph_rule(saved[0], saved[1], bits) if saved is not None and saved[0] is not None else None
    if (rule is None
            or (rule.kind in ("thresholds", "sided") and _representatives(rule.thresholds, x.dtype) is None)
            or (rule.kind == "normalize" and rule.groups and memory_order(x) != ())):  # (N, G, -1) of a permuted x
        return GraphRule("quantize", "", min_bits=bits)
    return dataclasses.replace(rule, min_bits=max(bits, rule.min_bits))


# NOTE [ The shape travels in an empty tensor ]
# What the traced pack returns becomes outputs of the forward graph and inputs of the backward one.
# Returned as a tuple of sizes, a shape under dynamic shapes is a set of symbolic-size nodes, and
# AOTAutograd's inlining of the hooks renames each such output node in place: a symbol two saved tensors
# share (a sequence length in every attention mask) is renamed twice and the forward graph ends up
# using a node before it defines it. So the shape travels as an empty tensor of that shape with a
# trailing 0 (no storage): the unpack reads its sizes, and only tensors cross the boundary.
def _shape_carrier(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape, 0))


def _carried_shape(carrier: torch.Tensor) -> tuple[tuple[Any, ...], Any]:
    """The shape ``_shape_carrier`` carries, and its number of values."""
    shape = tuple(carrier.shape[:-1])
    numel = 1
    for size in shape:
        numel = numel * size
    return shape, numel


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (to nearest, ties to even), in Python: the traced pack runs under a
    fake tensor mode, where a tensor's value cannot be read."""
    if dtype == torch.float16:
        try:
            return float(struct.unpack("<e", struct.pack("<e", value))[0])
        except OverflowError:
            return math.copysign(math.inf, value)
    try:
        single = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)
    if dtype != torch.bfloat16 or not math.isfinite(single):
        return float(single)
    bits = struct.unpack("<I", struct.pack("<f", single))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # at most 0xFF800000 (-inf): stays 32 bits
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def _representatives(thresholds: tuple[float, ...], dtype: torch.dtype) -> tuple[float, ...] | None:
    """A value below each of the sorted ``thresholds`` and above the one before it, and one above them
    all, that compare so in ``dtype``; ``None`` where ``dtype`` has none between two of them."""
    below = [thresholds[0] - max(1.0, abs(thresholds[0]))]
    below += [(a + b) / 2 for a, b in itertools.pairwise(thresholds)]
    cast = [_in_dtype(v, dtype) for v in (*below, thresholds[-1] + max(1.0, abs(thresholds[-1])))]
    edges = [_in_dtype(t, dtype) for t in thresholds]
    if edges != list(thresholds):
        return None  # a threshold the dtype cannot hold: the comparisons are not with it
    edges = [-math.inf, *edges, math.inf]
    if all(math.isfinite(c) and lo < c < hi for c, lo, hi in zip(cast, edges[:-1], edges[1:], strict=True)):
        return tuple(cast)
    return None


# NOTE [ Normalised values in a compiled graph ]
# The traced pack normalises with the eager encoding's ``normalized_over`` (records.py), without its one
# data-dependent branch, which a traced graph cannot take (the constant rows are handled whether or not
# there are any), over the value's own dims (or its ``(N, groups, -1)`` view): x_hat keeps the value's
# memory format where the statistics come from ``var_mean``.
def _normalized(x: torch.Tensor, rule: GraphRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = x.float()
    if rule.groups:
        values = values.reshape(values.shape[0], rule.groups, -1)
    x_hat, mean, std = normalized_over(values, rule.dims, rule.center, branch_free=True)
    return x_hat, torch.zeros_like(std) if mean is None else mean, std


@torch.fx.wrap
def pack_traced(x: torch.Tensor, bits: int | None, group_size: int, min_numel: int, pack_bool: bool,
                fitted_grids: bool = False, hooks_id: int = -1, position: int = -1) -> Any:
    """The pack hook inside a compiled graph: ``x`` kept, or a tuple whose first item says how it was
    stored (``unpack_traced`` reads it): the stored tensors, a carrier of the stored values' shape in
    memory order and ``back``, the permutation to ``x``'s (``NOTE [ The shape travels in an empty tensor
    ]``, ``NOTE [ Permuted memory formats in compiled graphs ]``), and the constants to restore it.
    ``position`` names the saved value for its fitted grid (``NOTE [ Fitted grids in compiled graphs ]``)."""
    rule = traced_treatment(x, bits, min_numel, pack_bool)
    if rule.kind == "keep":
        return x
    values, extra = x, ()
    if rule.kind == "normalize":
        values, mean, std = _normalized(x, rule)
        extra = (mean, std, tuple(x.shape), rule.dims, rule.center)
    elif rule.kind in ("probabilities", "log_probabilities"):
        extra = rule.dims
    order = memory_order(values) or ()  # not None: traced_treatment keeps those
    values = values.permute(order) if order else values
    back = _inverse(order) if order else ()
    if rule.kind == "bool":
        return ("bool", torch.ops.daftrain.pack_bool(values.reshape(-1)), _shape_carrier(values), back)
    if rule.kind in ("thresholds", "sided"):
        masks = torch.stack([m for t in rule.thresholds for m in (values < t, values == t)])
        sides = torch.ops.daftrain.pack_bool(masks.view(-1))
        if rule.kind == "thresholds":
            return ("thresholds", sides, _shape_carrier(values), back, x.dtype, rule.thresholds,
                    _representatives(rule.thresholds, x.dtype))
        extra = (sides, rule.thresholds)
    seed = torch.ops.daftrain.seed_in_graph(x, hooks_id)  # NOTE [ A fresh seed per compiled call ]
    flat = values.reshape(-1)
    grid = (torch.ops.daftrain.grid_in_graph(flat, rule.min_bits, hooks_id, position)
            if fitted_grids and rule.min_bits in GRID_BITS else None)
    codes, lo, scale = torch.ops.daftrain.quantize_pack_seeded(flat, rule.min_bits, group_size, seed, grid)
    return (rule.kind, codes, lo, scale, grid, _shape_carrier(values), back, x.dtype, rule.min_bits, group_size,
            *extra)


def _restored(flat: torch.Tensor, carrier: torch.Tensor, back: tuple[int, ...]) -> torch.Tensor:
    values = flat.view(_carried_shape(carrier)[0])
    return values.permute(back) if back else values


def _between(masks: torch.Tensor, thresholds: tuple[float, ...], representatives: tuple[float, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """Values that compare with each of ``thresholds`` as the masks (below, equal; per threshold) say."""
    values = torch.full(masks.shape[1:], representatives[-1], dtype=dtype, device=masks.device)
    for i in reversed(range(len(thresholds))):
        values = torch.where(masks[2 * i + 1], thresholds[i], torch.where(masks[2 * i], representatives[i], values))
    return values


def _sides(data: torch.Tensor, thresholds: tuple[float, ...], numel: int) -> torch.Tensor:
    """The masks ``pack_traced`` packed for ``numel`` values: below and equal to each threshold, one row each."""
    return torch.ops.daftrain.unpack_bool(data, 2 * len(thresholds) * numel).view(2 * len(thresholds), -1)


def _beside(threshold: float, dtype: torch.dtype, above: bool) -> float:
    """The value of ``dtype`` next to ``threshold`` (a value of ``dtype``) above or below it; next to 0 the
    smallest normal number, which no flush of denormals moves onto 0."""
    if threshold == 0:
        tiny = torch.finfo(dtype).tiny
        return tiny if above else -tiny
    value, word, shift = {torch.float16: ("<e", "<H", 0), torch.bfloat16: ("<f", "<I", 16)}.get(dtype, ("<f", "<I", 0))
    bits = struct.unpack(word, struct.pack(value, abs(threshold)))[0] >> shift
    bits += 1 if (threshold > 0) == above else -1
    return math.copysign(struct.unpack(value, struct.pack(word, bits << shift))[0], threshold)


def _on_their_sides(values: torch.Tensor, masks: torch.Tensor, thresholds: tuple[float, ...]) -> torch.Tensor:
    """``values`` with each one the rounding carried across a threshold put back next to it, on the side the
    masks (below, equal; per threshold) say: nearer the value it rounds than the rounded one was."""
    for i, t in enumerate(thresholds):
        below, equal = masks[2 * i], masks[2 * i + 1]
        kept_below = values.clamp(max=_beside(t, values.dtype, above=False))
        kept_above = values.clamp(min=_beside(t, values.dtype, above=True))
        values = torch.where(equal, t, torch.where(below, kept_below, kept_above))
    return values


@torch.fx.wrap
def unpack_traced(packed: Any, hooks_id: int = -1) -> torch.Tensor:
    """The unpack hook inside a compiled graph: the inverse of ``pack_traced``; ``hooks_id`` names the hook
    pair whose context counts the decoded bytes (``NOTE [ Heap trims in a compiled backward ]``)."""
    if isinstance(packed, torch.Tensor):
        return packed
    kind = packed[0]
    if kind == "bool":
        _, data, carrier, back = packed
        return _restored(torch.ops.daftrain.unpack_bool(data, _carried_shape(carrier)[1]), carrier, back)
    if kind == "thresholds":
        _, data, carrier, back, dtype, thresholds, representatives = packed
        masks = _sides(data, thresholds, _carried_shape(carrier)[1])
        return _restored(_between(masks, thresholds, representatives, dtype), carrier, back)
    _, codes, lo, scale, grid, carrier, back, dtype, bits, group_size, *extra = packed
    numel = _carried_shape(carrier)[1]
    stored_dtype = torch.float32 if kind == "normalize" else dtype
    flat = torch.ops.daftrain.decode_in_graph(codes, lo, scale, bits, group_size, numel, stored_dtype, hooks_id, grid)
    if kind == "sided":
        sides, thresholds = extra
        return _restored(_on_their_sides(flat, _sides(sides, thresholds, numel), thresholds), carrier, back)
    values = _restored(flat, carrier, back)
    if kind in ("probabilities", "log_probabilities"):  # NOTE [ Probabilities keep their sums ] in records.py
        (dim,) = extra
        return with_row_sums(values, dim, kind == "log_probabilities")
    if kind != "normalize":
        return values
    mean, std, shape, dims, center = extra
    scale, shift = restandardized(values, mean if center else None, std, dims)
    values = values * scale
    return (values if shift is None else values + shift).reshape(shape).to(dtype)


# NOTE [ Heap trims in a compiled backward ]
# Eager ``compress`` returns glibc's free heap to the OS every ``DEFAULT_TRIM_BYTES`` that pass through its
# hooks (``NOTE [ Freed memory goes back to the OS ]`` in allocator.py); a compiled graph runs with the
# hooks disabled, so its backward never trimmed, and what glibc kept of the decoded tensors freed layer
# by layer stayed resident (a compiled ResNet-18 at 2 bits: docs/memory.md, "Under torch.compile"). The
# traced unpack decodes through ``daftrain::decode_in_graph``, which decodes as ``unpack_dequantize`` does
# and counts the bytes on the context its hook pair last ran (``CompiledHooks.noted``), whose trimmer
# trims as the eager hooks' does; nothing where that context does not tune the allocator (CUDA,
# ``tune_allocator=False``) or is gone. With decodes at their first use (``NOTE [ Decodes at their first
# use ]``) a trim comes after the previous layers' decoded tensors were freed.
def _stateful_op(fn: Callable[..., Any]) -> Any:
    """``fn`` as the custom op ``daftrain::<its name>``, tagged as a random op where this torch takes tags: its
    result depends on more than its inputs, so no compiler may merge two of its calls or recompute one."""
    try:
        return torch.library.custom_op(f"daftrain::{fn.__name__}", fn, mutates_args=(),
                                       tags=(torch.Tag.nondeterministic_seeded,))
    except TypeError:  # an older torch: no tags on custom ops (its inputs differ per record: none is merged)
        return torch.library.custom_op(f"daftrain::{fn.__name__}", fn, mutates_args=())


@_stateful_op
def seed_in_graph(x: torch.Tensor, hooks_id: int) -> torch.Tensor:
    """A fresh 32-bit seed, as an int64 tensor on the CPU, for the record the hook pair ``hooks_id`` makes of ``x``
    (``NOTE [ A fresh seed per compiled call ]``)."""
    hooks = _HOOKS_BY_ID.get(hooks_id)
    seed = hooks.next_seed() if hooks is not None else record_seed(torch.initial_seed(), 0, 0)
    return torch.tensor(seed, dtype=torch.int64, device="cpu")


@seed_in_graph.register_fake
def _(x: torch.Tensor, hooks_id: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


# NOTE [ Fitted grids in compiled graphs ]
# Eager records take the grid ``GridChoice`` fits once per forward position (``NOTE [ Fitted grids ]`` in
# kernels/grids.py); a compiled graph's records kept the uniform grid, since fitting reads the values back to
# the host, which a traced graph cannot do: compiled models at 4 bits lost what grids give eager ones. The
# traced pack now gives each saved value a position of its own when it is traced, and
# ``daftrain::grid_in_graph`` asks the context that runs the graph for that position's grid, fitted and kept by
# the context's ``GridChoice`` beside its eager positions, numbered apart from them as compiled seeds are (again
# every ``REESTIMATE_STEPS`` steps or when the values change shape), the uniform grid where the fit found no gain
# or without a context. The grid travels to the backward with the record, as an eager record's does. The op
# returns a fresh tensor each call: a compiler may reuse the storage of an op's output once the graph no longer
# needs it. The CPU kernels run a uniform grid as no grid (the same bytes, ``layout.py``), so positions without a
# gain pay nothing.
@_stateful_op
def grid_in_graph(x: torch.Tensor, bits: int, hooks_id: int, position: int) -> torch.Tensor:
    """The grid (float32 ``[2**bits]``, on ``x``'s device) for the record the hook pair ``hooks_id`` makes of ``x``
    at saved-value ``position`` (``NOTE [ Fitted grids in compiled graphs ]``)."""
    hooks = _HOOKS_BY_ID.get(hooks_id)
    grid = hooks.grid(position, x, bits) if hooks is not None else None
    if grid is None:
        return torch.arange(1 << bits, dtype=torch.float32, device=x.device)
    return grid.clone()


@grid_in_graph.register_fake
def _(x: torch.Tensor, bits: int, hooks_id: int, position: int) -> torch.Tensor:
    return x.new_empty(1 << bits, dtype=torch.float32)


@torch.library.custom_op("daftrain::decode_in_graph", mutates_args=())
def decode_in_graph(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
                    numel: int, dtype: torch.dtype, hooks_id: int, grid: torch.Tensor | None = None) -> torch.Tensor:
    """``unpack_dequantize`` whose bytes the hook pair ``hooks_id`` notes (``NOTE [ Heap trims in a compiled
    backward ]``)."""
    values = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, group_size, numel, dtype, grid)
    hooks = _HOOKS_BY_ID.get(hooks_id)
    if hooks is not None:
        hooks.noted(values.numel() * values.element_size())
    return values


@decode_in_graph.register_fake
def _(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, numel: int,
      dtype: torch.dtype, hooks_id: int, grid: torch.Tensor | None = None) -> torch.Tensor:
    return codes.new_empty(numel, dtype=dtype)


def _hint(n: Any) -> int:
    """A size as an int, without guarding on a symbolic one (its hint)."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else 0
    return int(n)


@dataclasses.dataclass(frozen=True)
class SavedInGraph:
    """One saved tensor of a compiled graph, as the traced pack stored it."""

    node: str
    """The saved node's name in the forward graph."""
    how: str
    """"quantized", "bool" or "kept"."""
    bits: int
    raw_bytes: int
    stored_bytes: int


def _describe(packed: Any, x: torch.Tensor, node: Any) -> SavedInGraph:
    raw = _hint(x.numel()) * x.element_size()
    name = getattr(node, "name", "?")
    if isinstance(packed, torch.Tensor):
        return SavedInGraph(name, "kept", 0, raw, raw)
    if packed[0] == "bool":
        return SavedInGraph(name, "bool", 1, raw, bool_nbytes(_hint(x.numel())))
    if packed[0] == "thresholds":
        return SavedInGraph(name, "bool", 1, raw, bool_nbytes(2 * len(packed[5]) * _hint(x.numel())))
    bits, group_size = packed[8], packed[9]
    stored = PackedLayout(bits, group_size, _hint(x.numel())).nbytes
    if packed[0] == "normalize":
        stored += sum(_hint(t.numel()) * t.element_size() for t in packed[10:12])
    if packed[0] == "sided":
        stored += bool_nbytes(2 * len(packed[11]) * _hint(x.numel()))
    return SavedInGraph(name, "quantized", bits, raw, stored)


class _Hook(torch.fx.GraphModule):
    """A saved-tensor hook that is also a one-node ``GraphModule``; see ``NOTE [ Hooks inside compiled graphs ]``.

    ``torch.fx.GraphModule`` makes a class per instance whose ``__call__`` ends in this class's
    ``__call__`` (it defines one), so both autograd's eager calls and AOTAutograd's traced ones get here.
    """

    def __init__(self, fn: Callable[..., Any], constants: tuple[Any, ...], eager: Callable[[Any], Any],
                 traced: Callable[[Any], Any]) -> None:
        graph = torch.fx.Graph()
        arg = graph.placeholder("x")
        graph.output(graph.call_function(fn, (arg, *constants)))
        super().__init__(torch.nn.Module(), graph)
        self._eager, self._traced = eager, traced
        # ``recompile`` set the instance class's ``__call__`` to a wrapper that only adds error context to
        # the generated code's exceptions; without it, autograd's eager calls reach ``__call__`` directly.
        del type(self).__call__

    @never_a_frame  # NOTE [ Callbacks in a compiled function's eager code ] in callbacks.py
    def __call__(self, value: Any) -> Any:  # type: ignore[override]
        if is_traced(value):
            skip_frames()  # before the compiled function runs, with Dynamo loaded inside the context
            return self._traced(value)
        return eagerly(self._eager, value)


class _Owned:
    """An eager record's handle with the context that unpacks it (``NOTE [ No reference cycle ]`` in hooks.py)."""

    __slots__ = ("ctx", "handle")

    def __init__(self, ctx: Any, handle: Any) -> None:
        self.ctx, self.handle = ctx, handle


_PLAIN = (torch.Tensor, _Owned, KeptTensor)
"""What an eager pack hook is given or returns: never traced while no dispatch mode is active."""


class CompiledHooks:
    """The shared hook pair of one configuration and what its compiled graphs store.

    ``activate(ctx)`` / ``deactivate(ctx)`` bracket a context's ``with`` block on this thread; an eager
    pack goes to the innermost active context.
    """

    def __init__(self, bits: int | None, group_size: int, min_numel: int, pack_bool: bool,
                 fitted_grids: bool = False) -> None:
        self._constants = (bits, group_size, min_numel, pack_bool, fitted_grids)
        self.id = len(_HOOKS_BY_ID)
        _HOOKS_BY_ID[self.id] = self
        self.pack = _Hook(pack_traced, (*self._constants, self.id), self._eager_pack, self._traced_pack)
        self.unpack = _Hook(unpack_traced, (self.id,), _eager_unpack,
                            functools.partial(unpack_traced, hooks_id=self.id))
        self._local = threading.local()
        self._last: weakref.ReferenceType[Any] | None = None
        self._lock = threading.Lock()
        self._seeds = itertools.count()  # without a context (NOTE [ A fresh seed per compiled call ])
        self._positions = itertools.count()  # of the saved values traced (NOTE [ Fitted grids in compiled graphs ])
        # compile id -> (the forward graph while it is being compiled, its saved tensors by node name)
        self._graphs: dict[str, tuple[weakref.ReferenceType[Any], dict[str, SavedInGraph]]] = {}
        self._watching = False

    # -- the active context ------------------------------------------------------------------------
    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def activate(self, ctx: Any) -> None:
        self._stack().append(ctx)
        self._last = weakref.ref(ctx)
        if "torch._dynamo" in sys.modules:
            skip_frames()  # NOTE [ Callbacks in a compiled function's eager code ] in callbacks.py
            if self._constants[0] is not None or self._constants[3]:  # it decodes something
                install_decode_order()  # before a compile starts: inductor keeps its config for the backward

    def deactivate(self, ctx: Any) -> None:
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is ctx:
                del stack[i]
                return

    def active(self) -> Any:
        """The innermost context entered on this thread, else the one entered last on any thread."""
        stack = self._stack()
        if stack:
            return stack[-1]
        ctx = self._last() if self._last is not None else None
        if ctx is None:
            raise UnsupportedError(
                "daftrain.compress: a saved tensor reached the hooks of a context that is no longer "
                "entered; pack only inside its `with` block"
            )
        return ctx

    def next_seed(self) -> int:
        """The seed of the next record packed in a compiled graph, from the context that runs it (``NOTE [ A fresh
        seed per compiled call ]``)."""
        ctx = self._running()
        if ctx is not None:
            return ctx.compiled_seed()
        return record_seed(torch.initial_seed(), self.id, next(self._seeds))

    def grid(self, position: int, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        """The fitted grid of the record packed at ``position`` in a compiled graph, from the context that runs it,
        or ``None`` (``NOTE [ Fitted grids in compiled graphs ]``)."""
        ctx = self._running()
        return ctx.compiled_grid(position, values, bits) if ctx is not None else None

    def noted(self, nbytes: int) -> None:
        """Count ``nbytes`` decoded in a compiled graph on the context entered last, if it trims the heap
        (``NOTE [ Heap trims in a compiled backward ]``)."""
        ctx = self._last() if self._last is not None else None
        trimmer = getattr(ctx, "_trimmer", None)
        if trimmer is not None:
            trimmer.note(nbytes)

    def _active_or_none(self) -> Any:
        stack = self._stack()
        return stack[-1] if stack else None

    def _running(self) -> Any:
        """The context a compiled graph runs under: the innermost entered on this thread, else the one entered last
        on any thread (a backward on autograd's thread), or ``None``."""
        return self._active_or_none() or (self._last() if self._last is not None else None)

    # -- eager -------------------------------------------------------------------------------------
    def _eager_pack(self, t: torch.Tensor) -> Any:
        ctx = self.active()
        packed = ctx._pack(t)
        if isinstance(packed, torch.Tensor | KeptTensor):  # unpacking these needs no context
            return packed
        return _Owned(ctx, packed)

    # -- traced ------------------------------------------------------------------------------------
    def _traced_pack(self, x: torch.Tensor) -> Any:
        packed = pack_traced(x, *self._constants, self.id, next(self._positions))
        saved = _saved_node()
        if saved is None or saved[0] is None:  # traced by someone else than AOTAutograd's inlining
            return packed
        ctx = self._active_or_none()
        if ctx is not None:
            ctx._warn_if_untraceable()
        # NOTE [ Which compiled graphs the stats describe ]
        # Each graph's saved tensors are recorded when it is compiled, by Dynamo's compile id: a
        # recompilation of a frame adds a graph; the start of a compile drops what an earlier compile of
        # the same id recorded; ``torch._dynamo.reset()`` (which unregisters Dynamo's compile callbacks)
        # drops them all. Nothing is counted at run time: a compiled graph runs with the hooks disabled.
        compile_id = torch._guards.CompileContext.current_compile_id()
        key = str(compile_id) if compile_id is not None else f"graph {id(saved[0].graph)}"
        fw_graph = saved[0].graph
        self._watch_compiles()
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None or entry[0]() is not fw_graph:  # a new graph under this id replaces the old one
                entry = self._graphs[key] = (weakref.ref(fw_graph), {})
            entry[1][saved[0].name] = _describe(packed, x, saved[0])
        return packed

    def _watch_compiles(self) -> None:
        """Register ``_on_compile_start`` with Dynamo; if Dynamo dropped it (a reset), forget every graph."""
        from torch._dynamo.callback import callback_handler

        if self._on_compile_start not in callback_handler.start_callbacks:
            with self._lock:
                if self._watching:
                    self._graphs.clear()
                self._watching = True
            callback_handler.register_start_callback(self._on_compile_start)

    def _on_compile_start(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger == CallbackTrigger.DYNAMO:
            with self._lock:
                self._graphs.pop(str(args.compile_id), None)

    def graphs(self) -> list[list[SavedInGraph]]:
        """What each graph compiled under these hooks stores (``NOTE [ Which compiled graphs the stats
        describe ]``), in compilation order."""
        if self._watching and "torch._dynamo" in sys.modules:
            self._watch_compiles()
        with self._lock:
            return [list(saved.values()) for _, saved in self._graphs.values()]

    def fill(self, stats: Any) -> None:
        """Set the ``compiled_*`` fields of a ``CompressionStats`` from ``graphs()``."""
        graphs = self.graphs()
        stats.compiled_graphs = len(graphs)
        saved = [s for g in graphs for s in g]
        stats.compiled_saved = len(saved)
        stats.compiled_quantized = sum(s.how == "quantized" for s in saved)
        stats.compiled_bool_packed = sum(s.how == "bool" for s in saved)
        stats.compiled_raw_bytes = sum(s.raw_bytes for s in saved)
        stats.compiled_stored_bytes = sum(s.stored_bytes for s in saved)


def _eager_unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Owned):
        return packed.ctx._unpack(packed.handle)
    if isinstance(packed, KeptTensor):
        return packed.restore()
    return packed


def untraceable_reason(config: CompressionConfig, pool: Any) -> str | None:
    """Why a context with these settings cannot compress inside a compiled graph, or None."""
    reasons = [r for r, on in (('bits="auto"', config.auto), ("a PagePool", pool is not None),
                               ("asynchronous=True", config.asynchronous)) if on]
    return " and ".join(reasons) if reasons else None


_HOOKS: dict[tuple[Any, ...], CompiledHooks] = {}
_HOOKS_BY_ID: dict[int, CompiledHooks] = {}  # what ``decode_in_graph``'s constant names
_HOOKS_LOCK = threading.Lock()


def hooks_for(config: CompressionConfig, traceable: bool) -> CompiledHooks:
    """The one hook pair for these settings (``NOTE [ Hooks inside compiled graphs ]``, point 2): a
    traced path at ``config``'s bits (``None``: bool masks packed, the rest kept), or for untraceable
    settings the identity."""
    key = ((config.bits, config.group_size, config.min_numel, config.pack_bool, config.fitted_grids) if traceable
           else ("identity",))
    with _HOOKS_LOCK:
        hooks = _HOOKS.get(key)
        if hooks is None:
            hooks = _HOOKS[key] = (CompiledHooks(*key) if traceable  # type: ignore[arg-type]
                                   else CompiledHooks(None, config.group_size, 0, False))
        return hooks


def warn_untraceable(reason: str) -> None:
    warnings.warn(
        f"daftrain.compress: torch.compile compiled a graph under a context with {reason}, which cannot run "
        "inside a compiled graph: that graph's saved tensors are stored exact (only eager code and graph "
        "breaks are compressed). Use fixed bits (bits=1, 2, 4 or 8) without a pool and with "
        "asynchronous=False to compress compiled graphs.",
        CompileFallbackWarning,
        stacklevel=4,
    )
