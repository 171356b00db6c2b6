"""Attention that saves only its inputs (``saved/recomputed_attention.py``): plain SDPA bit for bit on exact
inputs, and under ``compress`` the exact gradient of attention at the rounded inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import daftrain
from daftrain.saved import recomputed_attention
from daftrain.saved.op_rules import OpTracer
from daftrain.saved.recomputed_attention import attention_recomputed, recomputes

B, H, T, D = 2, 4, 32, 16


def _qkv(seed: int = 0, kv_heads: int = H) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, T, D, generator=gen).requires_grad_()
            for heads in (H, kv_heads, kv_heads)]


def _bias() -> torch.Tensor:
    return (0.5 * torch.randn(1, H, T, T, generator=torch.Generator().manual_seed(9))).requires_grad_()


CALLS = {
    "plain": lambda: {},
    "causal": lambda: {"is_causal": True},
    "dropout": lambda: {"dropout_p": 0.3},
    "scale": lambda: {"scale": 1.0},
    "bool_mask": lambda: {"attn_mask": torch.rand(T, T, generator=torch.Generator().manual_seed(3)) > 0.3},
    "learned_bias": lambda: {"attn_mask": _bias() * 1.0},
    "learned_bias_dropout": lambda: {"attn_mask": _bias() * 1.0, "dropout_p": 0.2},
}


@pytest.mark.parametrize("chunk_bytes", [None, H * T * T * 4, 1], ids=["whole", "samples", "heads"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_plain_sdpa_bit_for_bit_on_exact_inputs(call: str, chunk_bytes: int | None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same output and gradients as PyTorch's SDPA (the same kernel and dropout mask, run twice), and the
    random stream left where plain leaves it; on the math path also run one sample or one head at a time (a
    learned bias shared by the samples then sums its gradient chunk by chunk: equal to float rounding)."""
    chunks: list[int] = []
    chunked = chunk_bytes is not None
    if chunked:
        monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", chunk_bytes)
        counted = recomputed_attention._chunked_grads

        def counting(*args: object) -> object:
            chunks.append(1)
            return counted(*args)

        monkeypatch.setattr(recomputed_attention, "_chunked_grads", counting)
    w = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    got = []
    for fn in (F.scaled_dot_product_attention, attention_recomputed):
        q, k, v = _qkv()
        kwargs = CALLS[call]()
        torch.manual_seed(5)
        out = fn(q, k, v, **kwargs)
        mask = kwargs.get("attn_mask")
        wrt = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
        got.append((out, torch.autograd.grad((out * w).sum(), wrt), torch.rand(4)))
    (out, grads, after), (out_r, grads_r, after_r) = got
    assert torch.equal(out, out_r)
    assert all(torch.equal(a, b) for a, b in zip(grads[:3], grads_r[:3], strict=True))
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) if chunked else torch.equal(a, b)
               for a, b in zip(grads[3:], grads_r[3:], strict=True))
    assert torch.equal(after, after_r)
    math_path = "dropout" in call or "learned" in call  # the fused kernels take the others
    assert len(chunks) == (1 if chunked and math_path else 0)


def test_grouped_query_heads() -> None:
    w = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    got = []
    for fn in (F.scaled_dot_product_attention, attention_recomputed):
        q, k, v = _qkv(kv_heads=1)
        out = fn(q, k, v, enable_gqa=True)
        got.append(torch.autograd.grad((out * w).sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))


@pytest.mark.parametrize("chunk_bytes", [None, H * T * T * 4, 1], ids=["whole", "samples", "heads"])
def test_double_backward_as_plain(chunk_bytes: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Plain SDPA's fused CPU kernel has no second derivative; with a learned bias it takes the math path, which has.
    # Chunked, the call runs again whole on q, k and v joined from their chunks' stored parts.
    if chunk_bytes is not None:
        monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", chunk_bytes)
    got = []
    for fn in (F.scaled_dot_product_attention, attention_recomputed):
        q, k, v = _qkv()
        bias = _bias()
        out = fn(q, k, v, attn_mask=bias * 1.0)
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        got.append(torch.autograd.grad(dq.pow(2).sum(), (q, k, v, bias)))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*got, strict=True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_only_calls_that_build_a_graph_are_taken_over() -> None:
    q, k, v = _qkv()
    assert recomputes((q, k, v), {})
    assert recomputes((q.detach(), k.detach(), v.detach()), {"attn_mask": _bias()})  # the mask's gradient
    assert not recomputes((q.detach(), k.detach(), v.detach()), {})
    with torch.no_grad():
        assert not recomputes((q, k, v), {})
    nested = torch.nested.nested_tensor([torch.randn(H, T, D), torch.randn(H, 8, D)], requires_grad=True)
    assert not recomputes((nested, nested, nested), {})


def _compressed_grads(bits: int, rules: bool, *, backward_inside: bool = False,
                      **kwargs: object) -> list[torch.Tensor]:
    ctx = daftrain.compress(bits=bits, min_numel=0, seed=3)
    if not rules:
        ctx._op_tracer = OpTracer(rules=())  # the hooks without the op rules: every saved tensor rounded alone
    q, k, v = _qkv()
    w = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    with ctx:  # activations, not leaves (which the hooks keep as parameters)
        loss = (F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, **kwargs) * w).sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return [q.grad, k.grad, v.grad]


def test_keys_gradient_sums_to_zero_at_rounded_inputs() -> None:
    # NOTE [ Attention recomputed from its stored inputs ]: a vector added to every key shifts each row's logits
    # by one number, which softmax ignores, so the keys' gradients sum to zero over the keys, at any q, k and v.
    # Backward at the rounded q, k and v keeps that to float rounding; with the output and logsumexp rounded
    # apart from them it fails by a clear share of the gradient.
    def leftover(grads: list[torch.Tensor]) -> float:
        dk = grads[1]
        return float(dk.sum(2).norm() / dk.norm())

    assert leftover(_compressed_grads(2, rules=True)) < 1e-5
    assert leftover(_compressed_grads(2, rules=False)) > 1e-2


@pytest.mark.parametrize("kwargs", [{}, {"dropout_p": 0.3}], ids=["fused", "dropout"])
def test_backward_inside_the_context_is_not_rounded_again(kwargs: dict[str, object],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", 1)  # the math path a sample at a time
    inside = _compressed_grads(4, rules=True, backward_inside=True, **kwargs)
    outside = _compressed_grads(4, rules=True, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))


@pytest.mark.parametrize("chunk_bytes", [recomputed_attention.CHUNK_BYTES, 1], ids=["whole", "chunked"])
def test_dropout_mask_is_the_forwards(chunk_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", chunk_bytes)
    # At 8 bits the gradient is plain's up to rounding (v at 8 bits: cosine ~0.99987) only if backward drew the
    # forward's dropout mask: with a fresh mask it is ~0.70.
    q, k, v = _qkv()
    w = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    (F.scaled_dot_product_attention(q, k, v, dropout_p=0.3) * w).sum().backward()
    ref = torch.cat([t.grad.reshape(-1) for t in (q, k, v)])
    got = torch.cat([g.reshape(-1) for g in _compressed_grads(8, rules=True, dropout_p=0.3)])
    assert F.cosine_similarity(got, ref, dim=0) > 0.999


def test_math_path_saves_its_dropout_mask_and_tells_its_transients(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Attention recomputed from its stored inputs ]: the forward draws the dropout mask and saves it, so
    # backward draws nothing (the random stream is untouched by it); the transients of each chunk, in forward
    # and in backward, are told to ``traffic`` (the context's heap trimmer), the fused path's are not.
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", H * T * T * 4)  # one sample a chunk: B chunks
    told: list[int] = []
    q, k, v = _qkv()
    out = attention_recomputed(q, k, v, dropout_p=0.3, traffic=told.append)
    assert out.grad_fn is not None
    stores = out.grad_fn.stores  # NOTE [ Chunks stored apart ]: each sample's q, k, v and dropout mask
    assert len(stores) == B
    for b, store in enumerate(stores):
        q_b, k_b, v_b, keep = store.saved_tensors
        assert all(torch.equal(part, t[b:b + 1]) for part, t in ((q_b, q), (k_b, k), (v_b, v)))
        assert keep.dtype == torch.bool and keep.shape == (1, H, T, T)
    per_sample = 6 * H * T * T * 4  # the math path's six probability-sized transients, float32
    assert told == [per_sample] * B  # forward, a sample at a time
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    out.sum().backward()
    assert torch.equal(torch.rand(4), expected)
    assert told == [per_sample] * (2 * B)
    told.clear()
    q, k, v = _qkv()
    attention_recomputed(q, k, v, traffic=told.append).sum().backward()  # the fused kernel
    assert told == []


def test_compress_stores_the_dropout_mask_at_one_bit_and_trims_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from daftrain.allocator import HeapTrimmer

    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", H * T * T * 4)
    noted: list[int] = []
    note = HeapTrimmer.note

    def counted(self: HeapTrimmer, nbytes: int) -> None:
        noted.append(nbytes)
        note(self, nbytes)

    monkeypatch.setattr(HeapTrimmer, "note", counted)
    ctx = daftrain.compress(bits=4, min_numel=0)
    assert ctx._trimmer is not None  # CPU, the allocator tuned (the default)
    q, k, v = _qkv()
    with ctx:
        out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, dropout_p=0.3)
    assert ctx.stats.bool_packed == B  # a chunk's part of the mask at a time (NOTE [ Chunks stored apart ])
    per_sample = 6 * H * T * T * 4
    assert noted.count(per_sample) == B
    out.sum().backward()
    assert noted.count(per_sample) == 2 * B


def test_one_sample_runs_a_group_of_heads_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # A long sequence in a batch of one: chunks of heads, whole groups of the query heads that share a key head
    # (here 4 query heads a key head: two chunks), each writing its own heads' gradients; plain SDPA bit for bit.
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", T * T * 4)  # one head's probabilities
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, T, D, generator=gen)
    k, v = (torch.randn(1, 2, T, D, generator=gen) for _ in range(2))
    chunks, shared = recomputed_attention._chunks(q, k, v, None)
    assert [(c.heads, c.kv_heads) for c in chunks] == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]
    assert not shared
    got = []
    for fn in (F.scaled_dot_product_attention, attention_recomputed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        out = fn(*leaves, dropout_p=0.2, enable_gqa=True)
        if fn is attention_recomputed:  # chunked: each chunk's part of the dropout mask stored beside its q, k, v
            assert [store.saved_tensors[3].shape for store in out.grad_fn.stores] == [(1, 4, T, T)] * 2
        got.append((out, torch.autograd.grad((out * out).sum(), leaves)))
    (out, grads), (out_r, grads_r) = got
    assert torch.equal(out, out_r) and all(torch.equal(a, b) for a, b in zip(grads, grads_r, strict=True))


@pytest.mark.parametrize("chunk_bytes", [recomputed_attention.CHUNK_BYTES, 1], ids=["whole", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plain_sdpa_bit_for_bit_under_autocast(chunk_bytes: int, dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Recomputed attention under autocast ]: float32 inputs cast as autocast's SDPA kernel casts them, the
    # math path's ops run in float32 as SDPA's do (under autocast each would run in ``dtype``), the output in
    # ``dtype``; the gradients flow back through the casts.
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", chunk_bytes)
    got = []
    for fn in (F.scaled_dot_product_attention, attention_recomputed):
        q, k, v = _qkv()
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=dtype):
            out = fn(q, k, v, dropout_p=0.3)
        got.append((out, torch.autograd.grad(out.float().square().sum(), [q, k, v])))
    (out, grads), (out_r, grads_r) = got
    assert out_r.dtype == dtype and torch.equal(out, out_r)
    assert all(g.dtype == torch.float32 and torch.equal(g, g_r) for g, g_r in zip(grads, grads_r, strict=True))


def test_the_inner_call_leaves_no_reference_cycle() -> None:
    # A saved output kept as the tensor itself would hold its own grad_fn: a cycle through C++ that no collector
    # frees, and every forward's attention output would stay resident (NOTE [ Attention recomputed from its
    # stored inputs ]).
    import gc
    import weakref

    from daftrain.saved.recomputed_attention import _attention

    q, k, v = _qkv()
    out = _attention(q, k, v, None, (0.0, False, None, False))
    assert out.grad_fn is not None
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None


class _RestoredCopies:
    """Saved-tensor hooks that store a copy and restore a fresh copy, counting at each restore how many earlier
    restored copies are still alive."""

    def __init__(self) -> None:
        import weakref

        self._ref = weakref.ref
        self.restored: list[object] = []
        self.alive_at_restore: list[int] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), self._unpack)

    def _unpack(self, stored: torch.Tensor) -> torch.Tensor:
        self.alive_at_restore.append(sum(ref() is not None for ref in self.restored))
        copy = stored.clone()
        self.restored.append(self._ref(copy))
        return copy


@pytest.mark.parametrize("kwargs", [{"dropout_p": 0.3}, {"attn_mask": "learned"}], ids=["dropout", "learned_bias"])
def test_backward_restores_one_chunk_at_a_time(kwargs: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Chunks stored apart ]: when a chunk's parts are restored, no earlier chunk's are alive: at the j-th
    # restore of a chunk's parts at most j - 1 copies are (restored whole, q, k and v were alive together).
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", H * T * T * 4)  # one sample a chunk
    copies = _RestoredCopies()
    q, k, v = _qkv()
    bias = _bias() if kwargs.get("attn_mask") == "learned" else None
    call = {**kwargs, "attn_mask": bias * 1.0} if bias is not None else kwargs
    w = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    with copies.hooks():
        out = attention_recomputed(q * 1.0, k * 1.0, v * 1.0, **call)
    parts = 4 if "dropout_p" in kwargs else 3  # q, k, v and the dropout mask (none without dropout)
    (out * w).sum().backward()
    restores = copies.alive_at_restore[1:] if bias is not None else copies.alive_at_restore  # the mask, first
    assert len(restores) == B * parts
    assert all(alive <= j % parts for j, alive in enumerate(restores)), restores


def test_chunk_stores_are_released_by_backward_and_kept_under_retain_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recomputed_attention, "CHUNK_BYTES", H * T * T * 4)
    q, k, v = _qkv()
    out = attention_recomputed(q * 1.0, k * 1.0, v * 1.0, dropout_p=0.3)
    stores = out.grad_fn.stores
    first = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    assert all(len(store.saved_tensors) == 4 for store in stores)  # kept for a second backward
    second = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    for store in stores:  # released as any node's saves are, once the engine ran them
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            _ = store.saved_tensors
