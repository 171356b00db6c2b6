"""Unusual saved tensors and unusual ways to run backward, under ``compress`` at ``bits`` None, 8 and 2.

Each case is compared with plain PyTorch on the same inputs: with ``bits=None`` the gradients are equal bit
for bit; quantized, they are finite, of the right dtype and shape, and close (the cosine bounds below).
Tensors daftrain keeps (integer, complex, sparse, nested, meta) give plain PyTorch's gradients at every
bit-width. Then: ``retain_graph``, double backward, ``torch.autograd.grad``, checkpointing inside the
context, an interrupt in forward or backward, and threads."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import daftrain

BITS = [None, 8, 2]
# Cosine similarity of a quantized gradient with plain PyTorch's, the bound a case must reach. One saved
# tensor of a few thousand values at 8 bits errs by ~0.4 % of its group range per value: 0.999 leaves a
# margin of ~10x over the measured worst case here (0.9997). At 2 bits the step is a third of the range;
# these small cases measure 0.86-0.999, so 0.7 catches a wrong restore (a transposed or shifted view
# gives ~0) without flaking on the rounding draw, which the fixed seed makes deterministic anyway.
MIN_COSINE = {8: 0.999, 2: 0.7}


def _leaf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], bits: int | None | str) -> list:
    for t in inputs:
        t.grad = None
    if bits == "plain":
        out = fn(*inputs)
    else:
        with daftrain.compress(bits=bits, min_numel=0, seed=1):
            out = fn(*inputs)
    out.backward()
    return [None if t.grad is None else t.grad.clone() for t in inputs]


def _as_real(t: torch.Tensor) -> torch.Tensor:
    t = t.to_dense() if t.layout != torch.strided else t
    return (torch.view_as_real(t) if t.is_complex() else t).double().flatten()


def _compare(ref: list, got: list, bits: int | None, *, exact: bool = False) -> None:
    for r, g in zip(ref, got, strict=True):
        assert (r is None) == (g is None)
        if r is None:
            continue
        assert g.dtype == r.dtype and g.shape == r.shape and g.layout == r.layout
        r, g = _as_real(r), _as_real(g)
        if bits is None or exact:
            torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
            continue
        assert torch.equal(g.isnan(), r.isnan()) and torch.isfinite(g[~r.isnan()]).all()
        r, g = r.nan_to_num(), g.nan_to_num()
        if r.numel() == 1:
            assert abs(g.item() - r.item()) <= 0.1 * abs(r.item()) + 1e-3  # one value: within its step
        else:
            assert F.cosine_similarity(g, r, dim=0) > MIN_COSINE[bits]


CASES: dict[str, tuple[Callable[..., torch.Tensor], Callable[[], list[torch.Tensor]]]] = {
    "non-contiguous": (lambda x: torch.sigmoid(x.t()).mul(x.t()).sum(), lambda: [_leaf(64, 32)]),
    "channels_last": (
        lambda x, w: F.relu(F.conv2d(x, w, padding=1)).pow(2).sum(),
        lambda: [torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last).requires_grad_(), _leaf(8, 8, 3, 3)],
    ),
    "transposed view saved": (lambda x, w: (torch.sigmoid(x).t() @ w).sum(), lambda: [_leaf(16, 64), _leaf(16, 8)]),
    "slices with gaps": (lambda x: (torch.sigmoid(x)[:, ::2] * torch.tanh(x)[:, 1::2]).sum(), lambda: [_leaf(32, 48)]),
    "0-d": (lambda x: torch.sigmoid(x) * torch.tanh(x), lambda: [torch.tensor(0.3, requires_grad=True)]),
    "float16": (lambda x: torch.sigmoid(x).mul(x).sum().float(), lambda: [_leaf(64, 64, dtype=torch.float16)]),
    "bfloat16": (lambda x: torch.sigmoid(x).mul(x).sum().float(), lambda: [_leaf(64, 64, dtype=torch.bfloat16)]),
    "float64": (lambda x: torch.sigmoid(x).mul(x).sum(), lambda: [_leaf(64, 64, dtype=torch.float64)]),
    "float64 view": (lambda x: (torch.sigmoid(x.t())[:, ::2] * x.t()[:, 1::2]).sum(),
                     lambda: [_leaf(64, 32, dtype=torch.float64)]),
    "complex": (lambda x: (x * torch.sigmoid(x.real)).abs().sum(), lambda: [_leaf(64, 64, dtype=torch.complex64)]),
    "integer (gather index)": (lambda x, i: x.gather(1, i).pow(2).sum(),
                               lambda: [_leaf(64, 64), torch.randint(0, 64, (64, 8))]),
    "bool (where mask)": (lambda x: torch.where(x > 0, x * x, torch.sigmoid(x)).sum(), lambda: [_leaf(64, 64)]),
    "NaN and Inf": (lambda x: (torch.sigmoid(x) * x).sum(),
                    lambda: [torch.tensor([[1.0, math.nan, math.inf, -math.inf] * 16] * 64).requires_grad_()]),
    "inputs requiring grad": (lambda x, w: torch.tanh(x @ w).sum(), lambda: [_leaf(32, 64), _leaf(64, 64)]),
}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("case", list(CASES))
def test_unusual_saved_tensor_matches_plain_pytorch(case, bits):
    fn, make = CASES[case]
    torch.manual_seed(0)
    inputs = make()
    _compare(_grads(fn, inputs, "plain"), _grads(fn, inputs, bits), bits)


@pytest.mark.parametrize("bits", BITS)
def test_non_finite_activations_give_plain_pytorchs_gradients_exactly(bits):
    """NaN and Inf keep their record exact (NOTE [ Non-finite activations ] in saved/records.py)."""
    fn, make = CASES["NaN and Inf"]
    inputs = make()
    _compare(_grads(fn, inputs, "plain"), _grads(fn, inputs, bits), bits, exact=True)


@pytest.mark.parametrize("bits", [8, 2])
def test_float64_is_stored_packed_and_restored_as_float64(bits):
    # NOTE [ Double precision stored through float32 ] in saved/hooks.py: a float64 activation was kept whole; its
    # record is now made from a float32 copy, as small as a float32 tensor's, and restored as float64.
    x = _leaf(256, 256, dtype=torch.float64)
    ctx = daftrain.compress(bits=bits, seed=1)
    with ctx:
        y = torch.tanh(x)
    restored = y.grad_fn._saved_result
    assert restored.dtype == torch.float64 and ctx.stats.kept == 0
    single = daftrain.compress(bits=bits, seed=1)
    with single:
        torch.tanh(x.detach().float().requires_grad_())
    assert ctx.stats.packed_bytes == single.stats.packed_bytes
    assert ctx.stats.raw_bytes == 2 * single.stats.raw_bytes


@pytest.mark.parametrize("bits", [8, 2])
def test_float64_values_beyond_float32s_range_are_kept_exact(bits):
    # Out of float32's range a value is an infinity in the copy: the record is kept, the float64 tensor itself
    # (not the copy), and the gradient is plain's bit for bit.
    x = torch.randn(64, 64, dtype=torch.float64)
    x[3, 5], x[7, 1] = 1e200, 1e-300
    fn = lambda x: (x * 1.0).pow(2).sum()  # noqa: E731  (pow saves its input)
    inputs = [x.requires_grad_()]
    _compare(_grads(fn, inputs, "plain"), _grads(fn, inputs, bits), bits, exact=True)
    # values all below float32's normal range over a group's levels: kept whole (in the copy, zeros or
    # subnormals: a zero gradient or one of a few bits)
    inputs = [(torch.randn(64, 64, dtype=torch.float64) * 1e-40).requires_grad_()]
    _compare(_grads(fn, inputs, "plain"), _grads(fn, inputs, bits), bits, exact=True)


@pytest.mark.parametrize("bits", BITS)
def test_sparse_saved_tensor_is_kept(bits):
    x = torch.randn(64, 64).relu().to_sparse().requires_grad_()
    w = _leaf(64, 16)
    fn = lambda x, w: torch.sparse.mm(x, w).sum()  # noqa: E731  (saves only the sparse x and the weight)
    _compare(_grads(fn, [x, w], "plain"), _grads(fn, [x, w], bits), bits, exact=True)
    # The dense product that pow saves is quantized as usual at 8 and 2 bits.
    fn = lambda x, w: torch.sparse.mm(x, w).pow(2).sum()  # noqa: E731
    _compare(_grads(fn, [x, w], "plain"), _grads(fn, [x, w], bits), bits)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("bits", BITS)
def test_nested_saved_tensor_is_kept(bits, layout):
    parts = [torch.randn(3, 8), torch.randn(5, 8)]

    def grad(bits):
        nt = torch.nested.nested_tensor(parts, layout=layout, requires_grad=True)
        with daftrain.compress(bits=bits, min_numel=0) as ctx:
            y = F.relu(nt) * nt
            out = sum(t.sum() for t in y.unbind())
        out.backward()
        return nt.grad, ctx.stats

    (ref, _), (got, stats) = grad(None), grad(bits)
    assert stats.kept_reasons["layout"] >= 1 and stats.compressed == 0
    for r, g in zip(ref.unbind(), got.unbind(), strict=True):
        assert torch.equal(r, g)


@pytest.mark.parametrize("bits", BITS)
def test_meta_tensors_run_forward_and_backward(bits):
    x = torch.randn(64, 64, device="meta", requires_grad=True)
    with daftrain.compress(bits=bits, min_numel=0) as ctx:
        y = (torch.sigmoid(x) * x).sum()
    y.backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape
    assert ctx.stats.compressed == 0 and ctx.stats.kept_reasons["layout"] >= 1


@pytest.mark.parametrize("bits", BITS)
def test_meta_attention_runs_forward_and_backward(bits):
    # the attention rule estimates from q's and k's values: a meta call (a dry run) has none and runs as it is
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, device="meta")
    x = torch.randn(2, 8, 32, device="meta", requires_grad=True)
    with daftrain.compress(bits=bits, min_numel=0) as ctx:
        y = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], dropout_p=0.1)
        y = layer(y[:, 0]).sum()
    y.backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape and ctx.stats.compressed == 0


# -- ways to run backward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_retain_graph_backward_three_times_decodes_the_same_values(bits):
    x = _leaf(64, 64)
    with daftrain.compress(bits=bits, min_numel=0, seed=1):
        y = (torch.sigmoid(x) * torch.tanh(x)).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward(retain_graph=True)
    assert torch.equal(x.grad, 2 * first)  # the second backward decodes the very same values
    y.backward()
    assert torch.equal(x.grad, 3 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()  # freed, as in plain PyTorch


def _double_backward(x: torch.Tensor, bits: int | None | str, *, inside: bool) -> torch.Tensor:
    """d/dx of |d/dx sum(tanh(x)^2)|^2; ``inside``: the first backward runs under the context too."""
    import contextlib

    x.grad = None
    ctx = daftrain.compress(bits=bits, min_numel=0, seed=1) if bits != "plain" else contextlib.nullcontext()
    with ctx:
        y = (torch.tanh(x) ** 2).sum()
        if inside:
            (g,) = torch.autograd.grad(y, x, create_graph=True)
    if not inside:
        (g,) = torch.autograd.grad(y, x, create_graph=True)
    g.pow(2).sum().backward()
    return x.grad.clone()


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_double_backward_keeps_the_second_order_graph(bits, inside):
    torch.manual_seed(0)
    x = _leaf(64, 64)
    ref = _double_backward(x, "plain", inside=inside)
    got = _double_backward(x, bits, inside=inside)
    if bits is None:
        assert torch.equal(got, ref)
    elif bits == 8:
        # The restored saved tensors carry their grad_fn: without the second-order terms through tanh's
        # saved output the cosine would fall far below this bound.
        assert F.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > MIN_COSINE[8]
    else:
        # Second-order terms multiply the 2-bit rounding error of tanh's output several times (measured
        # cosine ~0.3 here): only finiteness is a property of this bit-width.
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("bits", BITS)
def test_autograd_grad_equals_backward(bits):
    torch.manual_seed(0)
    x, w = _leaf(32, 64), _leaf(64, 64)
    with daftrain.compress(bits=bits, min_numel=0, seed=1):
        y = F.gelu(x @ w).pow(2).sum()
    gx, gw = torch.autograd.grad(y, [x, w], retain_graph=True)
    y.backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_checkpoint_inside_compress(bits, use_reentrant):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = _leaf(32, 64)

    def f(x):
        return (torch.tanh(checkpoint(block, torch.sigmoid(x), use_reentrant=use_reentrant)) ** 2).sum()

    f(x).backward()
    ref = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    with daftrain.compress(bits=bits, min_numel=0, seed=1, model=block):
        y = f(x)
    y.backward()
    _compare(ref, [p.grad for p in block.parameters()] + [x.grad], bits)


# -- an interrupt in the middle of a step -----------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


CONTEXTS = {"exact": {"bits": None}, "8 bits": {"bits": 8}, "2 bits": {"bits": 2},
            "asynchronous": {"bits": 2, "asynchronous": True}, "pool": {"bits": 2, "pool": True},
            "auto": {"bits": "auto"}}


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("kind", list(CONTEXTS))
def test_keyboard_interrupt_leaves_the_context_reusable(kind, where):
    """A KeyboardInterrupt in forward (inside the ``with``) or in backward (from a tensor hook) leaves the
    context as it leaves plain PyTorch: the next step under it runs, and equals a step under a context
    whose first step ran to completion."""

    def make_ctx(model):
        kwargs = dict(CONTEXTS[kind])
        pool = daftrain.PagePool() if kwargs.pop("pool", False) else None
        return daftrain.compress(model=model, pool=pool, seed=3, **kwargs)

    def interrupt(grad):
        raise KeyboardInterrupt

    model = _mlp()
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    ctx = make_ctx(model)
    loss = None
    with pytest.raises(KeyboardInterrupt):
        with ctx:
            h = model[1](model[0](x))
            if where == "forward":
                raise KeyboardInterrupt
            h.register_hook(interrupt)
            loss = F.cross_entropy(model[2:](h), y)
        loss.backward()
    del loss, h
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no hooks left installed
    model.zero_grad()
    with ctx:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    ref = make_ctx(model)
    for _ in range(2):  # the same step index as the interrupted context's second step
        model.zero_grad()
        with ref:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.equal(g, p.grad)


# -- threads ----------------------------------------------------------------------------------------------


def _train(model: nn.Module, ctx: daftrain.compress, steps: int, seed: int,
           barrier: threading.Barrier | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        if barrier is not None:
            barrier.wait(timeout=60)  # the two threads' steps overlap
        with ctx:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _in_two_threads(target: Callable[[int, threading.Barrier], list[torch.Tensor]]) -> dict[int, list]:
    out: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            out[i] = target(i, barrier)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(out) == 2
    return out


@pytest.mark.parametrize("kind", ["exact", "2 bits", "asynchronous"])
def test_two_threads_with_their_own_contexts_train_as_alone(kind):
    def ctx(seed):
        return daftrain.compress(seed=seed, **CONTEXTS[kind])

    alone = [_train(_mlp(), ctx(i), 10, i) for i in range(2)]
    models = [_mlp(), _mlp()]  # made here: torch.manual_seed is process-wide
    together = _in_two_threads(lambda i, barrier: _train(models[i], ctx(i), 10, i, barrier))
    for i in range(2):  # bit for bit: each context's rounding stream depends only on its own steps
        assert all(torch.equal(a, b) for a, b in zip(alone[i], together[i], strict=True))


@pytest.mark.parametrize("bits", [None, 2])
def test_one_context_shared_by_two_threads(bits):
    """One fixed-bits context entered from two threads at once: each thread's saved tensors go through its
    own hooks and come back to its own backward. Exact mode trains as alone, bit for bit; at 2 bits the
    step counter is shared (each entry is a step), so only closeness to exact training is checked."""
    shared = daftrain.compress(bits=bits, seed=5)
    initial = [p.detach().clone() for p in _mlp().parameters()]
    exact = [_train(_mlp(), daftrain.compress(bits=None), 10, i) for i in range(2)]
    models = [_mlp(), _mlp()]
    together = _in_two_threads(lambda i, barrier: _train(models[i], shared, 10, i, barrier))
    assert shared.step == 19
    for i in range(2):
        for p0, a, b in zip(initial, exact[i], together[i], strict=True):
            if bits is None:
                assert torch.equal(a, b)
            else:
                assert torch.isfinite(b).all()
                # 10 SGD steps from the same start: the 2-bit run's update points where the exact run's
                # does; saved tensors exchanged between the threads (other data) would not.
                assert F.cosine_similarity((b - p0).flatten(), (a - p0).flatten(), dim=0) > 0.9
