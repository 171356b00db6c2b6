"""compress_forward: every training forward under the context; Hugging Face gradient checkpointing swapped."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

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


class _Net(torch.nn.Module):
    """A model class of its own, whose ``forward`` Dynamo compiles as a frame (unlike torch.nn's containers)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("own_class", [True, False], ids=["own_class", "nn_sequential"])
@pytest.mark.parametrize("bits", [4, None])
def test_a_compiled_module_is_compressed(own_class, bits) -> None:
    # NOTE [ A compressed forward under torch.compile ] and NOTE [ Callbacks in a compiled function's eager code ]:
    # ``Trainer(args=TrainingArguments(torch_compile=True))`` compiles the model whose forward the callback
    # wrapped. A compiled ``nn.Sequential`` at 4 bits stored nothing compressed (cosine 1.0): its saves reached
    # daftrain's callbacks only as one-op graphs Dynamo compiled of them.
    torch.manual_seed(0)
    model = _Net() if own_class else _Net().inner
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    ctx = daftrain.compress(bits=bits)
    undo = compress_forward(model, ctx)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    try:
        for _ in range(2):
            model.zero_grad()
            compiled(x).square().sum().backward()
    finally:
        undo()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=0))
    # the model's own frame compiled with the hooks inlined, or torch.nn's container run eagerly under the
    # context: every save reaches daftrain either way, and Dynamo compiled no frame of daftrain's
    stored = ctx.stats.compiled_saved if own_class else ctx.stats.tensors_seen
    assert stored > 0, ctx.stats.summary()
    assert counter.frame_count == (1 if own_class else 0), counter.frame_count
    if bits is None:
        assert cos == pytest.approx(1.0, abs=1e-6)
    else:
        assert 0.99 < cos < 1 - 1e-6, cos  # rounded at 4 bits (a cosine of 1 would mean nothing was compressed)
