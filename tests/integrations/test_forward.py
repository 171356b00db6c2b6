"""compress_forward: every training forward under the context; Hugging Face gradient checkpointing swapped."""

from __future__ import annotations

import functools

import pytest
import torch

import daftrain
from daftrain.demo.models.transformers_zoo import bert_classifier
from daftrain.errors import UnsupportedError
from daftrain.integrations.forward import compress_forward


def _tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    model = bert_classifier(num_labels=3, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            intermediate_size=256)
    model.train()
    return model


def _grads(model: torch.nn.Module, ctx: daftrain.compress | None) -> torch.Tensor:
    model.zero_grad()
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 1000, (8, 64)), torch.randint(0, 3, (8,))
    undo = compress_forward(model, ctx) if ctx is not None else None
    try:
        model(input_ids=ids, labels=labels).loss.backward()
    finally:
        if undo is not None:
            undo()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_gradient_checkpointing_layers_recompute_compressed_and_are_restored() -> None:
    model = _tiny_bert()
    ref = _grads(model, None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if "_gradient_checkpointing_func" in m.__dict__]
    before = [m._gradient_checkpointing_func for m in layers]
    assert layers
    exact = _grads(model, daftrain.compress(bits=None, model=model))
    assert torch.equal(exact, ref)  # exact mode leaves torch.utils.checkpoint in place: bit-identical
    ctx = daftrain.compress(bits=8, model=model)
    grad = _grads(model, ctx)
    # 8-bit saved activations: the zoo sweep's floor for every architecture (docs/zoo.md) is 0.999.
    assert torch.nn.functional.cosine_similarity(grad, ref, dim=0) > 0.999
    recomputed = ctx.recomputation_context().stats
    assert recomputed.compressed > 0, recomputed.summary()
    assert [m._gradient_checkpointing_func for m in layers] == before  # undo put every function back


def test_other_checkpointing_functions_are_left_alone() -> None:
    model = _tiny_bert()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if "_gradient_checkpointing_func" in m.__dict__]
    custom = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False)
    for m in layers:
        m._gradient_checkpointing_func = custom
    undo = compress_forward(model, daftrain.compress(bits=2, model=model))
    assert all(m._gradient_checkpointing_func is custom for m in layers)
    undo()


def test_wrapping_twice_is_refused() -> None:
    model = _tiny_bert()
    ctx = daftrain.compress(bits=2, model=model)
    undo = compress_forward(model, ctx)
    with pytest.raises(UnsupportedError, match="already compressed"):
        compress_forward(model, ctx)
    undo()
