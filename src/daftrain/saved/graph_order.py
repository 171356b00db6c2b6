"""Where a compiled backward decodes its saved tensors: each just before its first use
(``NOTE [ Decodes at their first use ]``)."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from .. import kernels  # noqa: F401  (registers the daftrain ops the pass looks for)
from .graph_rules import is_incoming_gradient

__all__ = ["install_decode_order", "sink_decodes"]


# NOTE [ Decodes at their first use ]
# AOTAutograd inlines the unpack hook's graph right after the compiled backward's inputs, and inductor's
# reordering for peak memory keeps that order: decoding only allocates, and where nothing frees memory
# yet none of its heuristics prefers to wait. So every saved tensor was decoded, at full precision, before
# the first gradient was computed, and the backward held all of them at once: a compiled MiniLM + LoRA
# at 2 bits peaked higher in backward than it did in forward (docs/memory.md, "Under torch.compile").
# ``sink_decodes`` moves each decode (daftrain's unpack ops, and what the unpack graph computes from them
# and the saved inputs alone: a view, a permutation, the statistics of a normalised record) to just
# before its first use; inductor then frees each decoded tensor after its last use, and the backward holds
# the decoded tensors of the ops it runs, as eager code does. It runs as an inductor post-grad pass,
# added to ``torch._inductor.config.post_grad_custom_post_pass`` (beside any pass already there) when a
# context that decodes (fixed bits) is entered with Dynamo loaded: inductor takes its config when a
# compile starts and compiles the backward with it, so a pass added while the forward is traced would not
# act. In a graph without daftrain's decodes it moves nothing; other backends (``aot_eager``) keep
# AOTAutograd's order. The forward needs no pass in the graphs read so far: inductor's reordering packs
# each saved value just after it exists, since packing frees it.


def _decode_ops() -> frozenset[Any]:
    """What the traced unpack decodes with (``unpack_traced`` in compiled.py, which registers
    ``decode_in_graph``)."""
    return frozenset({torch.ops.daftrain.decode_in_graph.default, torch.ops.daftrain.unpack_bool.default})


def sink_decodes(graph: torch.fx.Graph) -> int:
    """Move each decode of ``graph`` to just before its first user; the number of nodes moved."""
    decodes = _decode_ops()
    nodes = list(graph.nodes)
    position = {node: float(i) for i, node in enumerate(nodes)}
    movable: set[torch.fx.Node] = set()  # decodes, and nodes computed from them and saved values alone
    for node in nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if node.target in decodes or (any(a in movable for a in inputs)
                                      and all(a in movable or _saved_input(a) for a in inputs)):
            movable.add(node)
    moved = 0
    for node in reversed(nodes):  # users first: each is in its final place when its inputs move
        if node not in movable or not node.users:
            continue
        first = min(node.users, key=position.__getitem__)
        if first.op == "output":
            continue
        first.prepend(node)
        position[node] = position[first] - 1e-6
        moved += 1
    return moved


def _saved_input(node: torch.fx.Node) -> bool:
    """An input of a backward graph other than an incoming gradient."""
    return node.op == "get_attr" or (node.op == "placeholder" and not is_incoming_gradient(node))


@functools.cache
def _decode_order_pass() -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class DecodeOrder(CustomGraphPass):
        """``sink_decodes`` as an inductor post-grad pass (keyed by this file for inductor's caches)."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            sink_decodes(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files((__file__,))

    return DecodeOrder()


def _chained(first: Any, then: Any) -> Any:
    """One inductor post-grad pass that runs ``first``, then ``then`` (``NOTE [ One post-grad pass or
    several ]``)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Chained(CustomGraphPass):
        def __init__(self) -> None:
            self.passes = (first, then)

        def __call__(self, graph: torch.fx.Graph) -> None:
            for graph_pass in self.passes:
                graph_pass(graph)

        def uuid(self) -> Any:
            uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
            return None if None in uuids else tuple(uuids)  # None: inductor does not cache such graphs

    return Chained()


def _takes_several_passes() -> bool:
    """Whether inductor's ``post_grad_custom_post_pass`` may be a sequence of passes (newer PyTorch)."""
    from torch._inductor import custom_graph_pass

    return hasattr(custom_graph_pass, "get_custom_graph_passes")


_INSTALL_LOCK = threading.Lock()


# NOTE [ One post-grad pass or several ]
# Newer inductors take a list of post-grad passes; older ones (PyTorch 2.11 among them) call the config's
# value, so a tuple there broke every compile in the process ("'tuple' object is not callable"), the
# user's own models included. Where a sequence is not taken, a pass already installed is chained with the
# decode order into one pass, which runs it first, as a list would.
def install_decode_order() -> None:
    """Add the decode-order pass to inductor's post-grad passes, once (``NOTE [ Decodes at their first use ]``)."""
    from torch._inductor import config

    order = _decode_order_pass()
    with _INSTALL_LOCK:
        current = config.post_grad_custom_post_pass
        if _takes_several_passes():
            passes = tuple(current) if isinstance(current, (list, tuple)) else (() if current is None else (current,))
            if order not in passes:
                config.post_grad_custom_post_pass = (*passes, order)
        elif current is None:
            config.post_grad_custom_post_pass = order
        elif current is not order and order not in getattr(current, "passes", ()):
            config.post_grad_custom_post_pass = _chained(current, order)
