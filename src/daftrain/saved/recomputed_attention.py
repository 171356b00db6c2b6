"""Attention that saves only its inputs and recomputes itself in backward (``NOTE [ Attention recomputed from
its stored inputs ]``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.nn.attention import SDPBackend

from .saved_apart import SavedApart

__all__ = ["CHUNK_BYTES", "attention_recomputed", "recomputes"]

CHUNK_BYTES = 2 << 20
"""On the CPU's math path, the call runs as many samples at a time as hold this many bytes of probabilities, or,
where one sample holds more, as many of its heads (at least the query heads that share a key head): its transients
are a few tensors of that size, not of the whole call's probabilities."""


# NOTE [ Attention recomputed from its stored inputs ]
# ``F.scaled_dot_product_attention`` saves, besides q, k and v, what its forward computed from them: the
# output and each row's logsumexp (the fused kernels), or the probabilities, the dropout mask and scaled
# copies of q and k (the math path, which the CPU takes under dropout or with a mask that requires grad:
# ``n**2`` values per head). Its backward relies on identities between them: the rows of
# ``exp(scale * q k^T - logsumexp)`` sum to 1, and ``rowsum(dO * out)`` equals ``rowsum(P * dP)``, so each
# row of the logits' gradient sums to zero. Rounded one by one, those tensors belong to no single forward:
# the identities fail and what they leave over is a bias of ``dq`` and ``dk`` that does not average out,
# large where probabilities are peaked (``NOTE [ Op rules ]``, 2.). Under the ``attention_qk`` rule the call
# runs as a function that saves only q, k, v and its mask (``NOTE [ Attention logits that need more than 8
# bits ]`` in ``attention_precision.py`` says how precisely) and, in backward, runs the same call again on
# the restored q, k and v (under the forward's random state: the same dropout mask) and backpropagates
# through it: the exact gradient of attention at the rounded inputs, every identity intact.
# It stores neither the output nor the logsumexp nor the probabilities (nor the dropout mask, but where the
# math path runs in chunks, below, at one bit a value): fewer bytes and a smaller gradient error, for one
# more forward of the attention per call in backward. Both runs go through the same path (grad enabled, the
# same inputs requiring grad, so the same kernel and dropout), with saved-tensor hooks that keep what the
# inner call saves as it is (detached: a saved output that held its own ``grad_fn`` would be a reference cycle
# through C++ that no collector frees), for as long as that one call's gradient is being taken. Under
# ``create_graph`` the second run uses the restored tensors themselves, so the gradient is differentiable in
# them. On the CPU's math path (dropout, or a mask that requires grad) the recomputation materialises the
# probabilities, their dropout mask and their gradients, several tensors of ``n**2`` values per head that
# plain PyTorch's backward holds fewer of: there backward recomputes a chunk of samples at a time, or of one
# sample's heads where a sample holds more than a chunk (``CHUNK_BYTES``; a long sequence in a small batch),
# through the math path's own ops (q and k each scaled by ``sqrt(scale)``, ``_safe_softmax``, the dropout mask
# divided by ``1 - p``): the gradient of the same function, chunk by chunk. Its forward runs those ops without
# a graph, a chunk at a time too, and draws the dropout mask itself (whole, before the first chunk), as the
# math path draws it (``bernoulli_`` over the probabilities' shape, into a bool tensor: the same values, the
# random stream left where plain leaves it, ``NOTE [ The dropout mask drawn as bool ]``), and saves it, a chunk's
# part beside the chunk's q, k and v (``NOTE [ Chunks stored apart ]``), which ``compress`` stores at one bit a
# value: drawing it again in backward cost as much time as the recomputation of the probabilities. What the math
# path makes and frees, in forward and in each chunk, is told to the context's heap trimmer as packed and restored
# tensors are (``traffic``): those blocks are below glibc's mmap threshold, and freed they would stay in its heap
# (``NOTE [ Freed memory goes back to the OS ]``).
def recomputes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an SDPA call with these arguments runs as ``attention_recomputed``: it builds a graph and its
    inputs are plain dense tensors."""
    names = ("query", "key", "value", "attn_mask")
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    q, k, v, mask = (bound.get(n) for n in names)
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested for t in (q, k, v)):
        return False
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.layout == torch.strided):
        return False
    grads = any(t.requires_grad for t in (q, k, v, mask) if isinstance(t, torch.Tensor))
    device = q.device.type  # type: ignore[union-attr]
    autocast = device not in _AUTOCAST_DEVICES and _autocasting(device)  # not known to cast as below
    return grads and torch.is_grad_enabled() and type(q) is torch.Tensor and not autocast


def attention_recomputed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                         scale: float | None = None, enable_gqa: bool = False, *,
                         traffic: Callable[[int], None] | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (the same signature and output) that saves only its inputs;
    ``traffic`` is told the bytes of the transients the CPU's math path makes and frees (``NOTE [ Freed memory
    goes back to the OS ]`` in ``allocator.py``)."""
    options = (dropout_p, is_causal, scale, enable_gqa)
    device = query.device.type
    if not _autocasting(device):
        return _apply(query, key, value, attn_mask, options, traffic)
    # NOTE [ Recomputed attention under autocast ]
    dtype = torch.get_autocast_dtype(device)
    query, key, value, attn_mask = (_autocast(t, dtype) for t in (query, key, value, attn_mask))
    with torch.autocast(device, enabled=False):
        return _apply(query, key, value, attn_mask, options, traffic)


def _apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           options: tuple[float, bool, float | None, bool], traffic: Callable[[int], None] | None) -> torch.Tensor:
    """The call as ``_Recomputed``, or, where it runs a chunk at a time, as ``_Chunked`` with each chunk's q, k, v
    and dropout mask saved apart (``NOTE [ Chunks stored apart ]``)."""
    chunking = _chunking(q, k, v, mask, options)
    if chunking is None:
        return _Recomputed.apply(q, k, v, mask, options, traffic)
    random = _RandomState(q.device) if options[0] > 0 else None
    keep = _dropout_keep(q, k, options) if options[0] > 0 else None
    stores: list[Any] = []
    if any(t.requires_grad for t in (q, k, v)):  # else the parts are constants, saved whole by ``_Chunked``
        for chunk in chunking[0]:
            parts = _parts(chunk, q, k, v, None)[:3]
            stores.append(SavedApart.apply(parts[0], *parts, keep[chunk.rows, chunk.heads] if keep is not None
                                           else None))
    return _Chunked.apply(q, k, v, mask, keep, options, traffic, chunking, random, *stores)


# NOTE [ Recomputed attention under autocast ]
# Autocast lists SDPA among the ops it runs in the lower precision on the CPU and on CUDA: its kernel casts every
# floating input but a float64 one to the autocast dtype (a cast autograd records) and runs the op with autocast
# off inside. A function in its place would instead run each of its ops under autocast (the math path's matmuls
# in bfloat16 where SDPA upcasts them to float32) on inputs its backward sees uncast. So the call casts its
# inputs as that kernel does and runs the function with autocast off: plain SDPA's output and gradients. Under
# autocast on other devices the call is left to SDPA (``recomputes``).
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda"})


def _autocasting(device: str) -> bool:
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # meta has no autocast


def _autocast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    return t


def _saves_as_stored() -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks under which an inner call's saves stay as they are, detached (``NOTE [ Attention recomputed from its
    stored inputs ]``)."""
    return torch.autograd.graph.saved_tensors_hooks(_detached, _as_stored)


def _leaf(t: torch.Tensor | None, needs: bool) -> torch.Tensor | None:
    """``t`` as a new leaf that requires grad where the call's gradient ``needs`` it."""
    return t.detach().requires_grad_(needs) if t is not None else None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               options: tuple[float, bool, float | None, bool]) -> torch.Tensor:
    dropout_p, is_causal, scale, enable_gqa = options
    with _saves_as_stored():
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                                           enable_gqa=enable_gqa)


class _RandomState:
    """The generator states a dropout draws from (the CPU's, and the device's where the inputs are on one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """The generators start from these states inside, and are put back as they were after."""
        with torch.random.fork_rng(devices=[self.device] if self.accelerator is not None else []):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None, options: tuple[float, bool, float | None, bool],
                traffic: Callable[[int], None] | None) -> torch.Tensor:
        ctx.options, ctx.traffic = options, traffic
        ctx.random = _RandomState(q.device) if options[0] > 0 else None
        ctx.needs = tuple(t is not None and t.requires_grad for t in (q, k, v, mask))
        ctx.save_for_backward(q, k, v, mask)
        with torch.enable_grad():
            leaves = [_leaf(t, needs) for t, needs in zip((q, k, v, mask), ctx.needs, strict=True)]
            return _attention(*leaves, ctx.options).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (*_whole_grads(ctx.saved_tensors, ctx.needs, ctx.options, ctx.random, grad), None, None)


def _whole_grads(saved: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...],
                 options: tuple[float, bool, float | None, bool], random: _RandomState | None,
                 grad: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients of q, k, v and the mask, the call run again whole on the ``saved`` q, k, v and mask (under
    ``create_graph`` on those tensors themselves)."""
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        inputs = [t if create_graph and t is not None and t.requires_grad else _leaf(t, n)
                  for t, n in zip(saved, needs, strict=True)]
        with random.restored() if random is not None else contextlib.nullcontext():
            out = _attention(*inputs, options)
    wrt = [t for t, n in zip(inputs, needs, strict=True) if n]
    grads = iter(torch.autograd.grad(out, wrt, grad, create_graph=create_graph))
    return [next(grads) if n else None for n in needs]


# NOTE [ Chunks stored apart ]
# Where the call runs a chunk at a time, backward needs one chunk's q, k, v and dropout mask at a time, and
# saved by the call itself they would be restored whole (``ctx.saved_tensors`` unpacks everything a node
# saved): four tensors of the call's inputs' size, decoded beside the gradients of q, k and v for the whole
# of its backward. So each chunk's parts are saved apart (``NOTE [ Saved apart ]`` in ``saved_apart.py``),
# before the call: the call's backward reads one chunk's at a time, and the parts it decoded are freed once
# their chunk's gradient is written. Under ``compress`` the pack hooks see each part inside the attention
# call, and the rule treats a slice of q or k as it treats q and k (``OpMatch.slices``). Under
# ``create_graph`` the call runs again whole on q, k and v joined from the restored parts. Where none of q, k
# and v requires grad their parts would make no node (constants, kept as they are either way) and the call
# saves them whole.
class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None, keep: torch.Tensor | None,
                options: tuple[float, bool, float | None, bool], traffic: Callable[[int], None] | None,
                chunking: tuple[list[_Chunk], bool], random: _RandomState | None,
                *stored: torch.Tensor) -> torch.Tensor:
        ctx.options, ctx.traffic, ctx.chunking, ctx.random = options, traffic, chunking, random
        ctx.stores = [s.grad_fn for s in stored]  # the nodes that saved each chunk's parts
        ctx.needs = tuple(t is not None and t.requires_grad for t in (q, k, v, mask))
        ctx.layouts = tuple(torch.empty_like(t, device="meta") for t in (q, k, v))
        ctx.save_for_backward(mask, *(() if stored else (q, k, v, keep)))
        with torch.no_grad():
            return _chunked_forward(q, k, v, mask, keep, options, chunking[0], traffic)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        mask = saved[0]
        chunks = ctx.chunking[0]
        parts: Iterator[tuple[torch.Tensor | None, ...]]
        if ctx.stores:  # NOTE [ Chunks stored apart ]: one chunk restored at a time
            parts = (store.saved_tensors for store in ctx.stores)
        else:
            q, k, v, keep = saved[1:]
            parts = ((*_parts(chunk, q, k, v, None)[:3], keep[chunk.rows, chunk.heads] if keep is not None else None)
                     for chunk in chunks)
        if torch.is_grad_enabled():  # create_graph: the call run again whole on the restored tensors themselves
            q, k, v = _joined(chunks, [p[:3] for p in parts])
            grads = _whole_grads((q, k, v, mask), ctx.needs, ctx.options, ctx.random, grad)
        else:
            grads = _chunked_grads(parts, ctx.layouts, mask, ctx.needs, ctx.options, grad, ctx.chunking,
                                   ctx.traffic)
        return (*grads, None, None, None, None, None, *(None for _ in ctx.stores))


def _chunking(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              options: tuple[float, bool, float | None, bool]) -> tuple[list[_Chunk], bool] | None:
    """The call's chunks (``_chunks``) where it runs a chunk at a time: the CPU's math path over 4-d q, k and v of
    one batch size, with more than one chunk's probabilities; else ``None``."""
    dropout_p, is_causal, scale, enable_gqa = options
    if q.device.type != "cpu" or not q.dim() == k.dim() == v.dim() == 4 or (scale is not None and scale < 0):
        return None
    if not q.shape[0] == k.shape[0] == v.shape[0] or (mask is not None and mask.dim() > 4):
        return None
    if torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale,
                               enable_gqa=enable_gqa) != SDPBackend.MATH.value:
        return None
    chunking = _chunks(q, k, v, mask)
    return chunking if len(chunking[0]) > 1 else None


_TRANSIENTS = 6
"""Tensors of the probabilities' size a run of the math path makes and frees: the logits, the probabilities, the
dropout mask and the product (and their gradients in backward)."""


class _Chunk(NamedTuple):
    """Part of a call: its samples, q's (and the output's) heads, k's and v's heads, and the mask's part (of the
    mask viewed as 4-d)."""

    rows: slice
    heads: slice
    kv_heads: slice
    mask: tuple[slice, slice]


def _chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None) -> tuple[list[_Chunk], bool]:
    """The call's chunks, each ``CHUNK_BYTES`` of probabilities or less where it can be: whole samples where one
    fits, else heads of one sample (whole groups of the query heads that share a key head), else one head; and
    whether the mask's gradient adds up over them (the mask is shared along a dim the chunks split)."""
    samples, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    fit = CHUNK_BYTES // max(1, _head_bytes(q, k))  # heads that fit in a chunk
    group = heads // kv_heads if kv_heads == v.shape[1] and heads % kv_heads == 0 else 0
    if fit >= heads or group == 0:
        step = max(1, fit // heads)
        spans = [(slice(b, b + step), slice(0, heads)) for b in range(0, samples, step)]
    else:
        step = max(group, fit // group * group)
        spans = [(slice(b, b + 1), slice(h, h + step)) for b in range(samples) for h in range(0, heads, step)]
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape) if mask is not None else (samples, heads)
    chunks = [_Chunk(rows, hs, slice(hs.start // group, hs.stop // group) if hs.stop - hs.start < heads
                     else slice(None), (rows if shape[0] == samples else slice(None),
                                        hs if shape[1] == heads else slice(None)))
              for rows, hs in spans]
    shared = ((shape[0] != samples and len({c.rows.start for c in chunks}) > 1)
              or (shape[1] != heads and len({c.heads.start for c in chunks}) > 1))
    return chunks, shared


def _head_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes of one head's probabilities (float32 on the CPU)."""
    return q.shape[2] * k.shape[2] * 4


def _as_4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    return mask[(None,) * (4 - mask.dim())] if mask is not None else None


def _parts(chunk: _Chunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None) -> list[torch.Tensor | None]:
    """q, k, v and the (4-d) mask of ``chunk``."""
    return [q[chunk.rows, chunk.heads], k[chunk.rows, chunk.kv_heads], v[chunk.rows, chunk.kv_heads],
            mask[chunk.mask] if mask is not None else None]


def _run(parts: list[torch.Tensor | None], keep: torch.Tensor | None,
         options: tuple[float, bool, float | None, bool], head_bytes: int,
         traffic: Callable[[int], None] | None) -> torch.Tensor:
    """A chunk's output from its ``parts`` (q, k, v and the mask): the math path op for op with the chunk's part of
    the forward's dropout mask, or the call itself where it has none; its transients told to ``traffic``."""
    q, k, v, mask = parts
    assert q is not None and k is not None and v is not None
    out = _attention(q, k, v, mask, options) if keep is None else _math(q, k, v, mask, keep, options)
    if traffic is not None:
        traffic(_TRANSIENTS * out.shape[0] * out.shape[1] * head_bytes)
    return out


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, keep: torch.Tensor | None,
          options: tuple[float, bool, float | None, bool]) -> torch.Tensor:
    """SDPA's math path, op for op, with its dropout ``keep`` mask given (bool, applied divided by ``1 - p``)."""
    dropout_p, is_causal, scale, enable_gqa = options
    dtype = q.dtype
    with _saves_as_stored():
        if dtype in (torch.float16, torch.bfloat16):  # the math path computes in float32 on the CPU
            q, k, v = q.float(), k.float(), v.float()
        if enable_gqa:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        attn = torch.matmul(q * root, k.transpose(-2, -1) * root)
        if is_causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            attn = attn + (torch.where(mask.logical_not(), -math.inf, 0.0).to(attn.dtype)
                           if mask.dtype == torch.bool else mask)
        attn = torch._safe_softmax(attn, -1)
        if keep is not None:
            attn = attn * keep.to(attn.dtype).div_(1 - dropout_p)
        return torch.matmul(attn, v).to(dtype)


# NOTE [ The dropout mask drawn as bool ]
# The math path draws its mask with ``bernoulli_`` on a tensor of the probabilities' dtype. On the CPU
# ``bernoulli_`` takes the same draws from the generator whatever the tensor's dtype (one seed for MKL's
# stream, or one draw per element) and writes them cast, so drawing into a bool tensor gives the same mask
# and leaves the generator where the math path leaves it, without a float buffer of the probabilities'
# size (the tests compare both with plain SDPA's, bit for bit).
def _dropout_keep(q: torch.Tensor, k: torch.Tensor, options: tuple[float, bool, float | None, bool]) -> torch.Tensor:
    """The math path's dropout mask for a call on ``q`` and ``k``, drawn as that path draws it (``bernoulli_``
    over the probabilities' shape), as bool (``NOTE [ The dropout mask drawn as bool ]``)."""
    heads = max(q.shape[1], k.shape[1])
    keep = torch.empty(q.shape[0], heads, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    return keep.bernoulli_(1 - options[0])


def _chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     keep: torch.Tensor | None, options: tuple[float, bool, float | None, bool],
                     chunks: list[_Chunk], traffic: Callable[[int], None] | None) -> torch.Tensor:
    """The call's output, a chunk at a time (``NOTE [ Attention recomputed from its stored inputs ]``)."""
    out: torch.Tensor | None = None
    mask4 = _as_4d(mask)
    for chunk in chunks:
        chunk_keep = keep[chunk.rows, chunk.heads] if keep is not None else None
        part = _run(_parts(chunk, q, k, v, mask4), chunk_keep, options, _head_bytes(q, k), traffic)
        if out is None:
            out = part.new_empty((q.shape[0], q.shape[1], *part.shape[2:]))
        out[chunk.rows, chunk.heads] = part
    assert out is not None
    return out


def _chunked_grads(parts: Iterable[tuple[torch.Tensor | None, ...]], layouts: tuple[torch.Tensor, ...],
                   mask: torch.Tensor | None, needs: tuple[bool, ...],
                   options: tuple[float, bool, float | None, bool], grad: torch.Tensor,
                   chunking: tuple[list[_Chunk], bool], traffic: Callable[[int], None] | None
                   ) -> list[torch.Tensor | None]:
    """The gradients of q, k, v and the mask, the call recomputed a chunk at a time from each chunk's ``parts`` (its
    q, k, v and dropout mask, restored one chunk at a time) with the dropout mask its forward drew (``NOTE [
    Attention recomputed from its stored inputs ]``); ``layouts`` are q, k and v on the meta device."""
    chunks, shared = chunking
    mask4 = _as_4d(mask)
    head_bytes = _head_bytes(layouts[0], layouts[1])
    # each chunk writes its part of q's, k's, v's (and the mask's) gradient; a shared mask's adds up
    results: list[torch.Tensor | None] = [
        torch.empty_like(t, device=grad.device) if n else None for t, n in zip(layouts, needs[:3], strict=True)]
    results.append(None if mask4 is None or not needs[3] else
                   torch.zeros_like(mask4) if shared else torch.empty_like(mask4))
    restored = iter(parts)
    for chunk in chunks:
        q, k, v, keep = next(restored)  # no other reference to them: freed by the ``del`` below
        with torch.enable_grad():
            leaves = [_leaf(t, n) for t, n in zip((q, k, v, mask4[chunk.mask] if mask4 is not None else None),
                                                  needs, strict=True)]
            out = _run(leaves, keep, options, head_bytes, traffic)
        del q, k, v, keep  # the restored parts: freed with the chunk (``NOTE [ Chunks stored apart ]``)
        wrt = [t for t, n in zip(leaves, needs, strict=True) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wrt, grad[chunk.rows, chunk.heads]))
        del out, leaves, wrt
        for i, index in enumerate(((chunk.rows, chunk.heads), (chunk.rows, chunk.kv_heads),
                                   (chunk.rows, chunk.kv_heads), chunk.mask)):
            target = results[i]
            if target is None:
                continue
            if i == 3 and shared:  # a mask shared along a split dim: its gradient sums over the chunks
                target[index] += next(grads)
            else:
                target[index] = next(grads)
    if results[3] is not None and mask is not None:
        results[3] = results[3].view(mask.shape)
    return results


def _joined(chunks: list[_Chunk], parts: list[tuple[torch.Tensor | None, ...]]) -> list[torch.Tensor]:
    """q, k and v joined from their chunks' ``parts`` (differentiably: under ``create_graph`` the parts restored are
    the saved slices themselves)."""
    by_rows: dict[int, list[tuple[torch.Tensor | None, ...]]] = {}
    for chunk, part in zip(chunks, parts, strict=True):
        by_rows.setdefault(chunk.rows.start, []).append(part)
    joined = []
    for i in range(3):
        rows = [[p[i] for p in ps] for ps in by_rows.values()]
        joined.append(torch.cat([torch.cat(r, 1) if len(r) > 1 else r[0] for r in rows], 0))  # type: ignore[misc]
    return joined
