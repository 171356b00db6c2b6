"""Op-aware compression across architectures from ``transformers`` built from tiny configs.

The fast tests take models whose gradients the op rules (``saved/op_rules.py``) are for: a ViT
(LayerNorm inputs whose rows have small spread), DeiT (class and distillation tokens of zeros under
LayerNorm with eps 1e-12), Qwen3 (QK-norm before scaled_dot_product_attention), MobileNetV2 (ReLU6 clip
masks, BatchNorm) and wav2vec2 (GELU through a convolutional feature encoder; its SpecAugment masks come
from numpy's generator, which ``zoo_gradient`` seeds, so plain PyTorch is reproducible) and YOSO
(``F.normalize`` of its attention's output: vectors of small norm in groups of large ones).
``benchmarks/bench_zoo.py`` runs the whole zoo; the slow test
checks that no architecture fails in any mode and that exact mode is bit-identical everywhere.
"""

from __future__ import annotations

import pytest
import torch
from helpers import statistics_not_stored

import daftrain
from daftrain.demo.models.torch_zoo import TORCH_ZOO, zoo_inputs, zoo_model
from daftrain.demo.models.transformers_zoo import TINY_ZOO, tiny_inputs, tiny_model
from daftrain.demo.models.transformers_zoo import zoo_gradient as _grads


def _entry(model_type):
    return next(e for e in TINY_ZOO if e[0] == model_type)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _exact_and_8_bits_checked(model_type):
    """Build ``model_type``, check exact mode bit-identical to plain PyTorch and 8 bits at >= 0.999; return
    ``grads(bits)``: the gradient under ``compress(bits=bits)`` (plain PyTorch's for ``None``)."""
    _, kind, overrides = _entry(model_type)
    model = tiny_model(model_type, overrides)
    inputs = tiny_inputs(model, kind)
    ref = _grads(model, inputs, None)

    def grads(bits):
        return ref if bits is None else _grads(model, inputs, daftrain.compress(bits=bits, model=model))

    assert torch.equal(_grads(model, inputs, daftrain.compress(bits=None, model=model)), ref)
    assert _cos(grads(8), ref) >= 0.999
    return grads


# The targets for every architecture: 8 bits >= 0.999 and 4 bits >= 0.98 gradient cosine against
# plain PyTorch on the same seeds (a one-step gradient of a random projection of the output).
@pytest.mark.parametrize("model_type", ["vit", "deit", "qwen3", "mobilenet_v2", "yoso", "t5", "swinv2",
                                        pytest.param("wav2vec2", marks=pytest.mark.slow)])
def test_op_rules_meet_the_8_and_4_bit_targets(model_type):
    grads = _exact_and_8_bits_checked(model_type)
    assert _cos(grads(4), grads(None)) >= 0.98


# An EfficientNet / MobileNetV3-style CNN as torchvision and timm build it: SiLU and Hardswish in place, which
# save autograd's copy of their input. Stored as plain values, that copy left the model under the 4-bit target
# under bfloat16 autocast; stored as f'(x) like the out-of-place ops' inputs, it meets it (docs/zoo.md).
@pytest.mark.parametrize("name", ["inverted_residual_cnn", "inverted_residual_cnn:bf16"])
def test_in_place_activations_meet_the_8_and_4_bit_targets(name):
    model, inputs = zoo_model(name), zoo_inputs(name)
    ref = _grads(model, inputs, None)
    assert _cos(_grads(model, inputs, daftrain.compress(bits=8, model=model)), ref) >= 0.999
    assert _cos(_grads(model, inputs, daftrain.compress(bits=4, model=model)), ref) >= 0.98


# The architectures the issue found crashing in backward on expanded views (a stride of 0): Funnel (a mask
# broadcast over heads through torch.where), RecurrentGemma (one key/value head expanded to all heads) and
# SwinV2 (F.normalize of an expanded tensor). Every mode runs; exact mode is bit-identical; 8 bits >= 0.999.
@pytest.mark.parametrize("model_type", ["funnel", "recurrent_gemma", "swinv2"])
def test_expanded_views_of_real_models_restore_in_every_mode(model_type):
    grads = _exact_and_8_bits_checked(model_type)
    assert torch.isfinite(grads(2)).all()


def test_speech_models_are_reproducible_in_plain_pytorch():
    _, kind, overrides = _entry("wav2vec2")
    model = tiny_model("wav2vec2", overrides)
    inputs = tiny_inputs(model, kind)
    assert torch.equal(_grads(model, inputs, None), _grads(model, inputs, None))


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "kind", "overrides"), TINY_ZOO, ids=[e[0] for e in TINY_ZOO])
def test_every_architecture_runs_and_exact_mode_is_bit_identical(model_type, kind, overrides):
    model = tiny_model(model_type, overrides)
    inputs = tiny_inputs(model, kind)
    ref = _grads(model, inputs, None)
    if not torch.equal(_grads(model, inputs, None), ref):
        pytest.xfail(f"{model_type}: plain PyTorch itself is not deterministic here")
    assert torch.equal(_grads(model, inputs, daftrain.compress(bits=None, model=model)), ref)
    for bits in (8, 4, 2):
        grads = _grads(model, inputs, daftrain.compress(bits=bits, model=model))
        assert torch.isfinite(grads).all(), f"{model_type} at {bits} bits"


def _mean_error(model, inputs, ref, make, draws=2):
    """The mean gradient error of each context's second step (auto's first is its adaptation step; fixed
    bits run one too, so that both are measured on the same rounding draws)."""
    errors = []
    for seed in range(draws):
        ctx = make(seed)
        _grads(model, inputs, ctx)
        errors.append(1.0 - _cos(_grads(model, inputs, ctx), ref))
    return sum(errors) / draws, ctx.stats.stored_bytes


# Issue 17: bits="auto" must not do worse than uniform bits at the same bytes. Before NOTE [ Below the width
# asked for ] and the floors counted in the budget, the llama family was 6x worse at 4 bits and BERT's
# attention and T5's projections paid for the op rules' 8-bit floors (benchmarks/bench_zoo_auto.py runs
# all 82 architectures). The mean over two rounding draws varies by a few per cent on these models: 10 %
# is outside that.
@pytest.mark.parametrize("model_type", ["gpt2", "llama", "bert", "t5", "resnet"])
@pytest.mark.parametrize("bits", [4, 2])
def test_auto_bits_are_no_worse_than_uniform_bits_at_the_same_bytes(model_type, bits):
    _, kind, overrides = _entry(model_type)
    model = tiny_model(model_type, overrides)
    _assert_auto_no_worse(model, tiny_inputs(model, kind), bits)


def _assert_auto_no_worse(model, inputs, bits):
    ref = _grads(model, inputs, None)
    fixed, fixed_bytes = _mean_error(model, inputs, ref, lambda s: daftrain.compress(bits=bits, model=model, seed=s))
    auto, auto_bytes = _mean_error(
        model, inputs, ref, lambda s: daftrain.compress(bits="auto", avg_bits=float(bits), model=model, seed=s))
    assert auto_bytes <= fixed_bytes
    assert auto <= 1.1 * fixed, (auto, fixed)


# The torch.nn architectures (demo/models/torch_zoo.py): recurrent layers, nn.Transformer's attention inside
# F.multi_head_attention_forward, complex FFTs and parameters, linear layers over transposed views, each in
# float32 and under bfloat16 autocast. Before the copies an op saves were recognised (lineage.py) and the
# rounding noise measured (NOTE [ Measured rounding noise ]), auto bits were 9x worse than uniform on the
# MLP-Mixer, 2x on nn.Transformer under autocast, and failed on complex gradients.
@pytest.mark.parametrize("name", TORCH_ZOO)
def test_every_torch_architecture_runs_and_exact_mode_is_bit_identical(name):
    model, inputs = zoo_model(name), zoo_inputs(name)
    ref = _grads(model, inputs, None)
    assert torch.equal(_grads(model, inputs, None), ref)
    assert torch.equal(_grads(model, inputs, daftrain.compress(bits=None, model=model)), ref)
    grads = _grads(model, inputs, daftrain.compress(bits=2, model=model))
    assert torch.isfinite(grads).all() and _cos(grads, ref) > 0.5


@pytest.mark.parametrize("name", [n for n in TORCH_ZOO if n.endswith(":channels_last")])
def test_channels_last_architectures_store_what_their_contiguous_twins_do(name):
    # NOTE [ Normalised records in memory order ]: a permuted layout changes the order of the stored
    # values, not which are compressed or how many bytes they take, except the statistics of a
    # normalisation input that the contiguous twin quantizes as it is (its groups lie inside one plane)
    # and channels_last normalises (NOTE [ Normalising only where groups straddle statistics ])
    stats, not_stored = [], []
    for entry in (name, name.removesuffix(":channels_last")):
        model, inputs = zoo_model(entry), zoo_inputs(entry)
        ctx = daftrain.compress(bits=2, model=model)
        ref = _grads(model, inputs, None)
        with statistics_not_stored() as skipped:
            grads = _grads(model, inputs, ctx)
        assert _cos(grads, ref) > 0.5
        stats.append(ctx.stats)
        not_stored.append(sum(skipped))
    assert stats[0].kept_reasons == stats[1].kept_reasons
    assert stats[0].packed_bytes + not_stored[0] == stats[1].packed_bytes + not_stored[1]
    assert stats[0].compressed == stats[1].compressed > 0


@pytest.mark.parametrize("name", [
    "mlp_mixer", "transformer_seq2seq:bf16", "transformer_encoder_postnorm", "spectral_operator",
    *(pytest.param(n, marks=pytest.mark.slow) for n in TORCH_ZOO
      if n not in ("mlp_mixer", "transformer_seq2seq:bf16", "transformer_encoder_postnorm", "spectral_operator")),
])
@pytest.mark.parametrize("bits", [4, 2])
def test_auto_bits_are_no_worse_than_uniform_bits_on_torch_architectures(name, bits):
    _assert_auto_no_worse(zoo_model(name), zoo_inputs(name), bits)


# A Hugging Face text encoder outside the zoo (benchmarks/bench_zoo_outside.py) whose second attention
# call has logits of std ~23 (a 512-wide head, scale 1): 8-bit q and k err them by ~0.29 nats, and its
# 8-bit gradient was at 0.957 until such a call's saves were kept exact
# (NOTE [ Attention logits that need more than 8 bits ]); recomputed from 8-bit q, k and v (NOTE [ Attention
# recomputed from its stored inputs ]) it is at ~0.985, kept exact ~0.9995.
def test_attention_with_large_logits_of_a_real_model():
    model = tiny_model("embedding_gemma2_text")
    inputs = tiny_inputs(model, "text")
    ref = _grads(model, inputs, None)
    ctx = daftrain.compress(bits=8, model=model)
    kept = _cos(_grads(model, inputs, ctx), ref)
    rounded = daftrain.compress(bits=8, model=model)
    rounded._op_tracer._attention.limit = float("inf")  # every call's q and k at 8 bits, as before
    assert kept >= 0.999 and _cos(_grads(model, inputs, rounded), ref) < 0.99
    # one call's q, k and v kept exact, the other call's at 8 bits
    assert ctx.stats.kept_reasons["op_rule"] == rounded.stats.kept_reasons["op_rule"] + 3


# Hugging Face gradient checkpointing under compress(model=...): ViTs' LayerNorm inputs (class tokens of zeros at
# eps 1e-12), and Swin's checkpointed stages holding checkpointed blocks (NOTE [ Hugging Face layers checkpointed
# under compress ]). Plain checkpointing recomputed each layer from its quantized input: DeiT at 8 bits 0.26.
@pytest.mark.parametrize("model_type", ["deit", "swin"])
def test_gradient_checkpointed_models_meet_the_8_and_4_bit_targets(model_type):
    _, kind, overrides = _entry(model_type)
    model = tiny_model(model_type, overrides)
    inputs = tiny_inputs(model, kind)
    model.gradient_checkpointing_enable()
    ref = _grads(model, inputs)
    assert _cos(_grads(model, inputs, daftrain.compress(bits=8, model=model)), ref) >= 0.999
    assert _cos(_grads(model, inputs, daftrain.compress(bits=4, model=model)), ref) >= 0.98
