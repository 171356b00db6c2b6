"""compress with the other users of saved-tensor hooks: nested hook contexts, ``save_on_cpu``,
``torch.utils.checkpoint`` (non-reentrant and reentrant) and selective activation checkpointing.
Each composes (gradients close to plain PyTorch, and compress sees exactly the saves docs/saved.md
says) or warns (``NestedSavedTensorsHooksWarning`` where compress silently replaces an outer context)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import daftrain
from daftrain.saved.nesting import NestedSavedTensorsHooksWarning

# Relative gradient error allowed against plain PyTorch at 8 bits: stochastic rounding of these
# 8K-element activations measured 0.1-0.4 %; a wrong restore (another tensor, garbage) gives O(1).
GRAD_RTOL = 2e-2

torch.manual_seed(0)
STEM = nn.Linear(128, 128)
BLOCK = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))  # the region under test
HEAD = nn.Linear(128, 10)
MODEL = nn.ModuleList([STEM, BLOCK, HEAD])
X = torch.randn(64, 128)


def _forward(region: Callable[[torch.Tensor], torch.Tensor] = BLOCK) -> torch.Tensor:
    return HEAD(region(STEM(X))).square().mean()


def _grads(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    MODEL.zero_grad(set_to_none=True)
    run().backward()
    return torch.cat([p.grad.flatten() for p in MODEL.parameters()])


PLAIN = _grads(_forward)


def _close(g: torch.Tensor) -> None:
    rel = ((g - PLAIN).norm() / PLAIN.norm()).item()
    assert rel < GRAD_RTOL, rel


def _ctx() -> daftrain.compress:
    return daftrain.compress(bits=8, model=MODEL)


def _saves_all() -> int:
    """Saves compress sees in the whole forward (the block included)."""
    ctx = _ctx()
    with ctx:
        _forward()
    return ctx.stats.tensors_seen


def _saves_block() -> int:
    """Saves made inside the block (its input saved by its first linear among them)."""
    ctx = _ctx()
    h = STEM(X)
    with ctx:
        BLOCK(h)
    return ctx.stats.tensors_seen


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NestedSavedTensorsHooksWarning)
        yield


def test_compress_inside_another_hook_context_warns_once_and_wins():
    outer_packs = []

    def pack(t):
        outer_packs.append(t.shape)
        return t

    ctx = _ctx()

    def run():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            return _forward()

    with pytest.warns(NestedSavedTensorsHooksWarning, match=r"test_composition.*pack\)"):
        g = _grads(run)
    assert outer_packs == []  # PyTorch applies only the innermost context
    assert ctx.stats.compressed > 0
    _close(g)
    with _no_warning():  # once per context
        _grads(run)
    with _no_warning():  # and never when nothing is nested
        with ctx:
            _forward()


def test_compress_inside_compress_warns_and_inner_wins():
    outer, inner = _ctx(), _ctx()

    def run():
        with outer:
            h = STEM(X)
            with inner:
                h = BLOCK(h)
            return HEAD(h).square().mean()

    with pytest.warns(NestedSavedTensorsHooksWarning, match=r"\(daftrain\.compress\)"):
        g = _grads(run)
    _close(g)
    assert inner.stats.tensors_seen == _saves_block()
    assert outer.stats.tensors_seen == _saves_all() - _saves_block()


def test_compress_inside_save_on_cpu_warns_and_compresses():
    ctx = _ctx()

    def run():
        with torch.autograd.graph.save_on_cpu(), ctx:
            return _forward()

    with pytest.warns(NestedSavedTensorsHooksWarning, match=r"save_on_cpu"):
        g = _grads(run)
    _close(g)
    assert ctx.stats.tensors_seen == _saves_all() and ctx.stats.compressed > 0


def test_save_on_cpu_inside_compress_keeps_its_region():
    ctx = _ctx()

    def region(h):
        with torch.autograd.graph.save_on_cpu():
            return BLOCK(h)

    def run():
        with ctx:
            return _forward(region)

    with _no_warning():
        g = _grads(run)
    _close(g)
    # save_on_cpu stores the block's saves (exact); compress sees only the rest
    assert ctx.stats.tensors_seen == _saves_all() - _saves_block()


@pytest.mark.parametrize("kind", ["non-reentrant", "selective"])
def test_checkpoint_inside_compress_recomputes_its_region(kind):
    ctx = _ctx()

    def policy(_ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = (functools.partial(create_selective_checkpoint_contexts, policy) if kind == "selective"
                  else None)

    def run():
        with ctx:
            return _forward(lambda h: checkpoint(BLOCK, h, use_reentrant=False,
                                                 **({"context_fn": context_fn} if context_fn else {})))

    with _no_warning():
        g = _grads(run)
    _close(g)
    # Of the region, only its input reaches compress (checkpoint saves it as any saved tensor, and
    # backward recomputes the region from the restored input); the selective policy's saved outputs
    # stay in checkpoint's own cache, exact.
    assert ctx.stats.tensors_seen == _saves_all() - _saves_block() + 1


def test_reentrant_checkpoint_inside_compress_compresses_its_saved_input():
    ctx = _ctx()

    def run():
        with ctx:
            return _forward(lambda h: checkpoint(BLOCK, h, use_reentrant=True))

    with _no_warning():
        g = _grads(run)
    _close(g)
    # The reentrant forward runs without grad (nothing saved inside); its saved input goes through
    # compress like any saved tensor, and backward recomputes the region from the restored input.
    assert ctx.stats.tensors_seen == _saves_all() - _saves_block() + 1


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_regions_inputs_are_kept_exact(use_reentrant: bool) -> None:
    # NOTE [ A checkpointed region's inputs are kept exact ]: in a forward that is a stem (which saves the batch, a
    # constant) and one checkpointed region, compress sees the region's input; kept, the recomputation and so every
    # gradient is plain's, bit for bit (at 2 bits: quantized, the region recomputed from a rounded input moved
    # every gradient).
    ctx = daftrain.compress(bits=2, model=MODEL, min_numel=0)

    def region(h: torch.Tensor) -> torch.Tensor:
        return HEAD(BLOCK(h))

    def run() -> torch.Tensor:
        with ctx:
            out = checkpoint(region, STEM(X), use_reentrant=use_reentrant)
        return out.square().mean()

    with _no_warning():
        g = _grads(run)
    assert torch.equal(g, _grads(lambda: region(STEM(X)).square().mean()))
    assert ctx.stats.kept_reasons["checkpoint"] == 1 and ctx.stats.compressed == 0


def test_only_the_checkpointed_regions_own_inputs_are_kept() -> None:
    # A custom Function's saves (daftrain's own: the activation that saves its derivative) outside the region go
    # through compress as before.
    ctx = daftrain.compress(bits=2, model=MODEL, min_numel=0)
    with ctx, _no_warning():
        h = F.gelu(STEM(X))
        checkpoint(BLOCK, h, use_reentrant=False).sum().backward()
    assert ctx.stats.kept_reasons["checkpoint"] == 1 and ctx.stats.compressed == 1  # GELU's f'(x)


def test_compress_inside_checkpoint_region_warns():
    ctx = _ctx()

    def region(h):
        with ctx:
            return BLOCK(h)

    def run():
        return _forward(lambda h: checkpoint(region, h, use_reentrant=False))

    with pytest.warns(NestedSavedTensorsHooksWarning, match=r"torch\.utils\.checkpoint"):
        g = _grads(run)
    _close(g)
    # compress replaced checkpoint's hooks: the region is stored (compressed), not recomputed
    assert ctx.stats.tensors_seen == _saves_block() and ctx.stats.compressed > 0


def test_torch_func_grad_inside_compress_raises_a_daftrain_error_that_says_what_to_do():
    from torch.func import functional_call, grad

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    params = dict(model.named_parameters())
    x = torch.randn(16, 8)

    def loss(p):
        return functional_call(model, p, (x,)).pow(2).mean()

    ctx = daftrain.compress(bits=8, min_numel=0)
    with pytest.raises(daftrain.UnsupportedError, match="outside the context") as info, ctx:
        grad(loss)(params)
    assert isinstance(info.value.__cause__, RuntimeError)
    grads = grad(loss)(params)  # outside the context, and the context still works afterwards
    with ctx:
        out = model(x)
    out.pow(2).mean().backward()
    assert ctx.stats.compressed > 0
    for name, p in model.named_parameters():  # 8 bits: within 2 %, as in the composing cases above
        assert (p.grad - grads[name]).norm() <= 0.02 * grads[name].norm(), name


ATTENTION = nn.Linear(128, 384)


def _attention_region(h: torch.Tensor) -> torch.Tensor:
    q, k, v = (t.view(8, 8, 4, 32).transpose(1, 2) for t in ATTENTION(h.view(8, 8, 128)).split(128, -1))
    return nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(64, 128)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_torch_checkpoint_region_runs_its_calls_as_plain(use_reentrant: bool) -> None:
    # NOTE [ Operator-level savings under other hooks ] in op_rules.py: inside a torch.utils.checkpoint region the
    # attention call is not run as the function that saves q, k and v only (its recomputation, outside the rules,
    # would hand that function plain SDPA's saves: a wrong gradient without an error), nor are GELU's inputs saved
    # as their derivative; the gradient is plain's to rounding.
    def region(h: torch.Tensor) -> torch.Tensor:
        return BLOCK(_attention_region(h))

    def grads(ctx: daftrain.compress | None, checkpointed: bool) -> torch.Tensor:
        MODEL.zero_grad(set_to_none=True)
        ATTENTION.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            h = STEM(X)
            h = checkpoint(region, h, use_reentrant=use_reentrant) if checkpointed else region(h)
            loss = HEAD(h).square().mean()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in (*MODEL.parameters(), *ATTENTION.parameters())])

    plain = grads(None, checkpointed=False)
    got = grads(_ctx(), checkpointed=True)
    assert ((got - plain).norm() / plain.norm()).item() < GRAD_RTOL
