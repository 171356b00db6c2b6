"""Decodes at their first use in compiled backwards (saved/graph_order.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import daftrain
from daftrain.saved import graph_order
from daftrain.saved.graph_order import install_decode_order, sink_decodes


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decoding_graph() -> tuple[torch.fx.Graph, torch.fx.Node, torch.fx.Node]:
    """A backward-like graph: two records decoded after the inputs, each used by a later product."""
    graph = torch.fx.Graph()
    grad = graph.placeholder("tangents_1")
    records = [[graph.placeholder(f"{name}{i}") for name in ("codes", "lo", "scale")] for i in range(2)]
    decoded = []
    for codes, lo, scale in records:
        flat = graph.call_function(torch.ops.daftrain.decode_in_graph.default,
                                   (codes, lo, scale, 2, 256, 1024, torch.float32, -1))
        decoded.append(graph.call_function(torch.ops.aten.view.default, (flat, [32, 32])))
    first = graph.call_function(torch.ops.aten.mm.default, (grad, decoded[1]))
    second = graph.call_function(torch.ops.aten.mm.default, (first, decoded[0]))
    graph.output((second,))
    return graph, first, second


def test_each_decode_moves_to_just_before_its_first_use():
    graph, first, second = _decoding_graph()
    assert sink_decodes(graph) == 4  # two decodes and their views
    graph.lint()  # still topologically sorted
    order = [n for n in graph.nodes if n.op == "call_function"]
    names = [str(n.target) for n in order]
    assert names == ["daftrain.decode_in_graph.default", "aten.view.default", "aten.mm.default",
                     "daftrain.decode_in_graph.default", "aten.view.default", "aten.mm.default"], names
    assert order[2] is first and order[5] is second
    assert sink_decodes(graph) == 4 and [str(n.target) for n in graph.nodes if n.op == "call_function"] == names


def test_nothing_moves_in_a_graph_without_decodes():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (y, x)),))
    assert sink_decodes(graph) == 0


def test_installed_once_beside_other_passes():
    from torch._inductor import config

    def other(graph):
        return None

    with config.patch(post_grad_custom_post_pass=other):
        install_decode_order()
        install_decode_order()
        passes = config.post_grad_custom_post_pass
    assert len(passes) == 2 and passes[0] is other


class _Counting(CustomGraphPass):
    """A user's own post-grad pass: counts the graphs it sees, on the class (inductor deep-copies a pass
    that is not in a tuple when it reads its config)."""

    graphs = 0

    def __call__(self, graph):
        type(self).graphs += 1

    def uuid(self):
        return b"counting"


def test_one_pass_where_inductor_takes_one(monkeypatch):
    # NOTE [ One post-grad pass or several ]: an inductor that calls the config's value got a tuple
    from torch._inductor import config

    monkeypatch.setattr(graph_order, "_takes_several_passes", lambda: False)
    with config.patch(post_grad_custom_post_pass=None):
        install_decode_order()
        install_decode_order()
        assert config.post_grad_custom_post_pass is graph_order._decode_order_pass()
    other = _Counting()
    _Counting.graphs = 0
    with config.patch(post_grad_custom_post_pass=other):
        install_decode_order()
        chained = config.post_grad_custom_post_pass
        install_decode_order()
        assert config.post_grad_custom_post_pass is chained and callable(chained)
        assert chained.passes == (other, graph_order._decode_order_pass())
        assert chained.uuid() == (b"counting", graph_order._decode_order_pass().uuid())
        chained(torch.fx.Graph())
    assert _Counting.graphs == 1


@pytest.mark.parametrize("several", [True, False], ids=["passes_in_a_list", "one_pass"])
def test_compiled_backward_decodes_each_record_when_it_is_needed(several, monkeypatch):
    # AOTAutograd inlines every decode right after the backward's inputs; before the pass, inductor
    # decoded all of them before the first matmul (NOTE [ Decodes at their first use ]). Beside a user's
    # own pass, in a list or chained with it (NOTE [ One post-grad pass or several ]).
    from torch._inductor import config

    monkeypatch.setattr(graph_order, "_takes_several_passes", lambda: several)
    _Counting.graphs = 0
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)], nn.Linear(256, 10))
    x = torch.randn(512, 256)
    compiled = torch.compile(model)
    ctx = daftrain.compress(bits=2)

    def step():
        with ctx:
            out = compiled(x)
        out.sum().backward()

    # a cached graph runs no pass
    with (config.patch(post_grad_custom_post_pass=_Counting(), fx_graph_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=False)):
        _, codes = run_and_get_code(step)
    backward = next(c for c in codes if "tangents" in c)
    calls = [line.strip() for line in backward.splitlines()
             if "decode_in_graph.default(" in line or "extern_kernels.mm(" in line]
    decodes = [i for i, c in enumerate(calls) if "decode_in_graph" in c]
    assert len(decodes) == 8, calls  # each Linear's input and each GELU's input
    matmuls = [i for i, c in enumerate(calls) if "extern_kernels.mm" in c]
    # between any two decodes there is a matmul: each record is decoded for the layer being differentiated
    assert all(any(a < m < b for m in matmuls) for a, b in itertools.pairwise(decodes)), calls
    assert _Counting.graphs >= 2  # the forward and the backward: the user's pass still runs
