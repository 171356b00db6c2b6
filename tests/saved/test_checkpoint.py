"""daftrain.checkpoint: exact where nothing compresses, the recomputation stored compressed, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import daftrain
from daftrain import (
    ArgumentTypeError,
    DaftrainError,
    InPlaceModificationError,
    RecomputationMismatchError,
    UnsupportedError,
)


class Block(nn.Module):
    """Linear, GELU, dropout (the RNG a recomputation must replay), linear, LayerNorm, residual."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop, self.norm = nn.Dropout(0.2), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.down(self.drop(nn.functional.gelu(self.up(x)))))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(3)))


def _grads(model: nn.Sequential, x: torch.Tensor, ckpt: bool, ctx: daftrain.compress | None = None,
           compression: daftrain.compress | None = None) -> torch.Tensor:
    model.zero_grad()
    torch.manual_seed(1)
    proj = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    with ctx if ctx is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        h = x
        for block in model:
            h = daftrain.checkpoint(block, h, compression=compression) if ckpt else block(h)
        loss = (h * proj).sum()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a, b, dim=0))


def test_exact_recomputation_is_bit_identical_with_dropout() -> None:
    model, x = _model(), torch.randn(64, 128)
    assert torch.equal(_grads(model, x, ckpt=True), _grads(model, x, ckpt=False))


def test_recomputation_is_stored_compressed() -> None:
    model, x = _model(), torch.randn(64, 128)
    ref = _grads(model, x, ckpt=False)
    ctx = daftrain.compress(bits=8, model=model)
    grad = _grads(model, x, ckpt=True, ctx=ctx, compression=ctx)
    # 8-bit stochastic rounding of every saved activation: the op-family floor (tests/saved/test_hooks.py,
    # 38 dB) means a relative error below ~1.3 %, i.e. a cosine above 0.9999; 0.999 leaves room for seeds.
    assert _cos(grad, ref) > 0.999
    assert ctx.stats.compressed == 0  # the forward saved nothing inside the blocks
    inner = ctx.recomputation_context().stats  # the last block's recomputation
    assert inner.compressed >= 3 and inner.packed_bytes < inner.raw_bytes / 3


def test_op_rules_functions_run_in_the_region_and_its_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Operator-level savings under other hooks ]: a region's saves reach daftrain's hooks, and backward
    # recomputes it under the rules, so the GELU of each block runs as the function that saves its derivative in
    # the forward and again in the recomputation (the same saves, in the same order).
    from daftrain.saved import activation_derivative

    calls: list[int] = []
    apply = activation_derivative._SavingDerivative.apply
    monkeypatch.setattr(activation_derivative._SavingDerivative, "apply",
                        lambda *args: (calls.append(1), apply(*args))[1])
    model, x = _model(), torch.randn(64, 128)
    ref = _grads(model, x, ckpt=False)
    ctx = daftrain.compress(bits=8, model=model)
    assert _cos(_grads(model, x, ckpt=True, ctx=ctx, compression=ctx), ref) > 0.999
    assert len(calls) == 2 * len(model)


def test_two_bit_recomputation_stores_a_tenth() -> None:
    model, x = _model(), torch.randn(64, 128)
    ctx = daftrain.compress(bits=2, model=model)
    grad = _grads(model, x, ckpt=True, ctx=ctx, compression=ctx)
    assert torch.isfinite(grad).all()
    inner = ctx.recomputation_context().stats
    assert inner.stored_bytes < (inner.raw_bytes - inner.kept_bytes) / 8 + inner.kept_bytes


def test_auto_bits_recompute_at_the_default_fixed_bits() -> None:
    model = _model()
    ctx = daftrain.compress(bits="auto", model=model)
    assert ctx.recomputation_context().config.bits == daftrain.CompressionConfig().bits


def test_an_error_share_bound_recomputes_at_eight_bits() -> None:
    # No fixed width is known to hold the bound; a recomputation's records live one block at a time.
    ctx = daftrain.compress(bits="auto", error_share=0.01, model=_model())
    assert ctx.recomputation_context().config.bits == 8 and not ctx.recomputation_context().config.auto


@pytest.mark.parametrize(("avg_bits", "bits"), [(2.0, 2), (3.5, 2), (4.0, 4), (1.5, 1), (8.0, 8)])
def test_auto_bits_with_avg_bits_recompute_at_its_bytes(avg_bits: float, bits: int) -> None:
    """The bytes an ``avg_bits`` target asks for: what its allocation stores before the first estimate."""
    ctx = daftrain.compress(bits="auto", avg_bits=avg_bits, model=_model())
    assert ctx.recomputation_context().config.bits == bits
    assert not ctx.recomputation_context().config.auto


def test_retain_graph_recomputes_again() -> None:
    model, x = _model(), torch.randn(64, 128, requires_grad=True)
    ctx = daftrain.compress(bits=None)
    out = daftrain.checkpoint(model[0], x, compression=ctx).sum()
    (first,) = torch.autograd.grad(out, x, retain_graph=True)
    (second,) = torch.autograd.grad(out, x)
    assert torch.equal(first, second)


def test_no_grad_runs_plainly() -> None:
    model, x = _model(), torch.randn(4, 128)
    model.eval()
    with torch.no_grad():
        assert torch.equal(daftrain.checkpoint(model[0], x), model[0](x))


def test_different_recomputation_raises() -> None:
    calls = [0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return x.exp() if calls[0] == 1 else x.sin().cos()

    x = torch.randn(8, requires_grad=True)
    out = daftrain.checkpoint(fn, x)
    with pytest.raises(RecomputationMismatchError, match="same ops on recomputation") as info:
        out.sum().backward()
    assert isinstance(info.value, DaftrainError)


def test_input_modified_in_place_raises() -> None:
    model = _model()
    x = torch.randn(4, 128)
    out = daftrain.checkpoint(model[0], x)
    x.add_(1.0)
    with pytest.raises(InPlaceModificationError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_backward_inside_the_function_is_refused() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(x.pow(3).sum(), x, create_graph=True)
        return x * g

    x = torch.randn(8, requires_grad=True)
    with pytest.raises(UnsupportedError, match=r"torch\.utils\.checkpoint"):
        daftrain.checkpoint(fn, x).sum().backward()


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(ArgumentTypeError, match="fn must be callable"):
        daftrain.checkpoint(3, torch.randn(2))
    with pytest.raises(ArgumentTypeError, match=r"compression must be a daftrain\.compress context"):
        daftrain.checkpoint(torch.sin, torch.randn(2), compression=daftrain.CompressionConfig())


def test_a_drop_in_for_torch_checkpoint() -> None:
    model, x = _model(), torch.randn(16, 128, requires_grad=True)
    torch.manual_seed(3)
    out = daftrain.checkpoint(model[0], x, use_reentrant=False)
    (mine,) = torch.autograd.grad(out.sum(), x)
    torch.manual_seed(3)
    ref = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=False)
    (theirs,) = torch.autograd.grad(ref.sum(), x)
    assert torch.equal(mine, theirs)  # same dropout mask, replayed in the recomputation
    with pytest.raises(UnsupportedError, match="context_fn"):
        daftrain.checkpoint(model[0], x, context_fn=lambda: None)
    with pytest.raises(ArgumentTypeError, match="preserve_rng_state must be a bool"):
        daftrain.checkpoint(model[0], x, preserve_rng_state="yes")


def test_without_preserving_the_rng_dropout_draws_anew() -> None:
    model, x = _model(), torch.randn(16, 128)
    torch.manual_seed(3)
    out = daftrain.checkpoint(model[0], x, preserve_rng_state=False)
    forward_mask_draws = torch.get_rng_state()
    out.sum().backward()  # the recomputation draws its dropout mask from the global stream, which moves on
    assert not torch.equal(torch.get_rng_state(), forward_mask_draws)


def _checkpointed_bert() -> nn.Module:
    from daftrain.demo.models.transformers_zoo import bert_classifier

    torch.manual_seed(0)
    model = bert_classifier(num_labels=3, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            intermediate_size=256)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _bert_grads(model: nn.Module, ctx: daftrain.compress | None, inside=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    model.zero_grad()
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 1000, (8, 64)), torch.randint(0, 3, (8,))
    if ctx is None:
        loss = model(input_ids=ids, labels=labels).loss
    else:
        with ctx:
            if inside is not None:
                inside()
            loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_compress_given_the_model_recomputes_its_checkpointed_layers_compressed() -> None:
    # NOTE [ Hugging Face layers checkpointed under compress ]: swapped while the context is entered, put back at
    # its exit; the layers' recomputation is stored through the recomputation context.
    model = _checkpointed_bert()
    layers = [m for m in model.modules() if "_gradient_checkpointing_func" in m.__dict__]
    before = [m._gradient_checkpointing_func for m in layers]
    assert layers
    ref = _bert_grads(model, None)
    ctx = daftrain.compress(bits=8, model=model)
    swapped: list[bool] = []
    grad = _bert_grads(model, ctx, lambda: swapped.extend(
        getattr(m._gradient_checkpointing_func, "func", None) is daftrain.checkpoint for m in layers))
    # The two encoder layers, which call it; BertModel holds the attribute too and never calls it.
    assert swapped == [type(m).__name__ == "BertLayer" for m in layers] and sum(swapped) == 2
    assert [m._gradient_checkpointing_func for m in layers] == before
    # 8-bit saved activations: the zoo sweep's floor for every architecture (docs/zoo.md) is 0.999.
    assert torch.nn.functional.cosine_similarity(grad, ref, dim=0) > 0.999
    assert ctx.recomputation_context().stats.compressed > 0
    assert ctx.stats.kept_reasons["checkpoint"] == 2  # the stats count what each layer's boundary holds exact
    # Without the model, the layers keep PyTorch's checkpointing: recomputed exactly, their inputs kept exact.
    plain_ctx = daftrain.compress(bits=8)
    _bert_grads(model, plain_ctx)
    assert plain_ctx.stats.kept_reasons["checkpoint"] == 2  # one input per encoder layer
