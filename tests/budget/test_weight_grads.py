"""Weight gradients accumulated in place (NOTE [ Weight gradients accumulated in place ]): the same
gradients as autograd's, no weight-sized tensor in backward, and autograd's path wherever it must be."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from daftrain.budget.weight_grads import weight_grads_in_place

# Float64 throughout: the in-place path adds the same products in another order, so the gradients agree
# with autograd's to float64 rounding of sums of a few hundred terms, not bit for bit.
RTOL, ATOL = 1e-12, 1e-14


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 300, dim: int = 16, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.body = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _twins(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = TiedLM(**kwargs).double()
    return model, copy.deepcopy(model)


def _ids(seed: int, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(seed))


def _assert_grads_close(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("padding_idx", [None, 5])
def test_accumulated_gradients_match_autograd(padding_idx):
    model, twin = _twins(padding_idx=padding_idx)
    batches = [_ids(1), _ids(2)]
    batches[0][0, :3] = 5  # the padding row appears
    for ids in batches:  # two micro-batches: the second adds into existing gradients
        _loss(twin, ids).backward()
        with weight_grads_in_place(model) as affected:
            _loss(model, ids).backward()
    assert affected == 4  # the embedding and three Linear layers (the tied head among them)
    _assert_grads_close(model, twin)  # the padding row gets only the head's contribution, as in autograd


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any op allocates while active (in-place ops return their input: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t._base is None and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("in_place", [False, True])
def test_backward_allocates_no_weight_sized_tensor(in_place):
    """From the second micro-batch on: autograd allocates the tied weight's gradient twice over (the
    head's contribution, then the embedding's dense one); in place, no op returns a tensor that large."""
    model, _ = _twins(vocab=4000, dim=64)  # the weight (4000 x 64) is larger than the logits (21 x 4000)
    weight_numel = model.embed.weight.numel()
    ids = _ids(3, vocab=4000)
    _loss(model, ids).backward()  # gradients exist now
    context = weight_grads_in_place(model) if in_place else torch.enable_grad()
    with context:
        loss = _loss(model, ids)
        with _LargestOutput() as seen:
            loss.backward()
    assert (seen.largest < weight_numel) == in_place, (seen.largest, weight_numel)


def test_retain_graph_accumulates_twice():
    model, twin = _twins()
    ids = _ids(4)
    for m, context in ((twin, torch.enable_grad()), (model, weight_grads_in_place(model))):
        with context:
            loss = _loss(m, ids)
            loss.backward(retain_graph=True)
            loss.backward()
    _assert_grads_close(model, twin)


def test_create_graph_returns_the_gradient_to_autograd():
    """A double backward needs the weight gradient in the graph: the layer hands it to autograd."""
    model, twin = _twins()
    ids = _ids(5)
    results = []
    for m, context in ((twin, torch.enable_grad()), (model, weight_grads_in_place(model))):
        with context:
            (g,) = torch.autograd.grad(_loss(m, ids), m.body[0].weight, create_graph=True)
            g.pow(2).sum().backward()
        results.append(m.body[2].weight.grad)
    torch.testing.assert_close(results[1], results[0], rtol=RTOL, atol=ATOL)


def test_weights_with_hooks_and_replaced_layers_run_as_usual():
    model, twin = _twins()
    calls = []
    model.body[0].weight.register_post_accumulate_grad_hook(lambda p: calls.append("post"))
    model.body[2].weight.register_hook(lambda g: calls.append("pre") or g)
    model.body[2].forward = model.body[2].forward  # replaced by someone else: not ours to wrap
    with weight_grads_in_place(model) as affected:
        _loss(model, _ids(6)).backward()
    _loss(twin, _ids(6)).backward()
    assert affected == 3  # the embedding, body[0] (its hook is checked per call) and the head
    assert sorted(calls) == ["post", "pre"]
    _assert_grads_close(model, twin)
    assert "forward" in vars(model.body[2]) and "forward" not in vars(model.body[0])  # restored on exit


def test_autocast_and_frozen_weights_run_as_usual():
    torch.manual_seed(0)
    model = TiedLM().float()
    model.body[0].weight.requires_grad_(False)
    ids = _ids(7)
    with weight_grads_in_place(model), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        assert logits.grad_fn.name() != "_LinearInPlaceBackward"
    with weight_grads_in_place(model):
        model(ids).sum().backward()
    assert model.body[0].weight.grad is None and model.body[2].weight.grad is not None


def test_saved_tensor_hooks_that_copy_still_reach_the_parameter():
    """Hooks may unpack a copy of a saved parameter; the gradient still lands on the parameter."""
    model, twin = _twins()
    ids = _ids(8)
    with weight_grads_in_place(model), torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        _loss(model, ids).backward()
    _loss(twin, ids).backward()
    _assert_grads_close(model, twin)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_layers_recompute_under_the_context(use_reentrant):
    model, twin = _twins()
    ids = _ids(9)

    def loss_of(m: TiedLM) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(m.body, m.embed(ids), use_reentrant=use_reentrant)
        return F.cross_entropy(m.head(hidden).flatten(0, 1), ids.flatten())

    with weight_grads_in_place(model):
        loss_of(model).backward()
    loss_of(twin).backward()
    _assert_grads_close(model, twin)


def test_an_in_place_linear_is_seen_as_linear_by_torch_function_modes():
    """NOTE [ Seen as a linear ]: the layer's input is saved inside a call named ``linear``, with
    ``F.linear``'s arguments, so tracers attribute it as they do autograd's own linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    saved_during: list[str | None] = []
    current: list[str] = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            current.append(getattr(func, "__name__", ""))
            try:
                out = func(*args, **(kwargs or {}))
            finally:
                current.pop()
            return out

    def pack(t):
        saved_during.append(current[-1] if current else None)
        return t

    with weight_grads_in_place(model) as n, Mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert n == 2
        model(x).sum().backward()
    # each Linear's input and weight are saved inside ``linear``: none outside a traced call
    assert saved_during.count("linear") == 4 and None not in saved_during
    assert model[0].weight.grad is not None
