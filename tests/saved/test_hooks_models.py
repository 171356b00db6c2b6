"""compress() on whole models: a small ResNet, GPT-2, and BERT/RoBERTa with LoRA (no model rewrite)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import sqnr_db, statistics_not_stored

import daftrain
from daftrain.demo.models.resnet import resnet18
from daftrain.demo.models.transformers_zoo import bert_classifier, gpt2_lm, roberta_classifier, with_lora

# Gradient SNR floors (dB) for whole models, one forward+backward, min_numel=1024. Measured minima
# over three seeds (8 / 4 / 2 bits): ResNet 44.9 / 20.2 / 3.5, GPT-2 43.7 / 19.0 / 4.9, BERT+LoRA
# 96.9 / 71.7 / 53.8, RoBERTa+LoRA 97.2 / 70.9 / 57.3. LoRA's gradients are far cleaner because only
# the adapters train (lora_B starts at zero, so its gradient depends on the saved inputs through the
# low-rank A projection). The floors leave 3-8 dB of margin; a wrong restore gives negative values.
MODEL_SNR_FLOOR_DB = {
    "resnet": {8: 40.0, 4: 15.0, 2: 0.0},
    "gpt2": {8: 38.0, 4: 14.0, 2: 1.0},
    "bert_lora": {8: 85.0, 4: 60.0, 2: 45.0},
    "roberta_lora": {8: 85.0, 4: 60.0, 2: 45.0},
}


def _resnet():
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=8)
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 10, (8,))
    return model, lambda: F.cross_entropy(model(x), y)


def _gpt2():
    model = gpt2_lm(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=256, dropout=0.1, seed=0)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _encoder_lora(builder):
    def make():
        base = builder(num_labels=3, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                       intermediate_size=128, vocab_size=300, max_position_embeddings=80, dropout=0.1, seed=0)
        model = with_lora(base, r=4, modules_to_save=["classifier"])
        ids = torch.randint(3, 300, (4, 64), generator=torch.Generator().manual_seed(0))
        labels = torch.tensor([0, 1, 2, 1])
        return model, lambda: model(input_ids=ids, labels=labels).loss

    return make


MODELS = {
    "resnet": _resnet,
    "gpt2": _gpt2,
    "bert_lora": _encoder_lora(bert_classifier),
    "roberta_lora": _encoder_lora(roberta_classifier),
}


def _grads(model, loss_fn, ctx):
    model.train()
    model.zero_grad()
    torch.manual_seed(123)  # the same dropout masks with and without compression
    if ctx is None:
        loss = loss_fn()
    else:
        with ctx:
            loss = loss_fn()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.fixture(scope="module", params=list(MODELS))
def model_case(request):
    model, loss_fn = MODELS[request.param]()
    ref = _grads(model, loss_fn, None)
    return request.param, model, loss_fn, ref


def test_exact_mode_is_bit_identical(model_case):
    _, model, loss_fn, ref = model_case
    state = {k: v.clone() for k, v in model.state_dict().items()}
    got = _grads(model, loss_fn, daftrain.compress(bits=None, model=model))
    model.load_state_dict(state)  # BatchNorm running stats moved; put them back for the next test
    assert torch.equal(got, ref)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_gradient_snr(model_case, bits):
    name, model, loss_fn, ref = model_case
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = daftrain.compress(bits=bits, model=model, min_numel=1024, seed=bits)
    got = _grads(model, loss_fn, ctx)
    model.load_state_dict(state)
    assert ctx.stats.compressed >= 4, ctx.stats.summary()
    assert ctx.stats.ratio > 1.5, ctx.stats.summary()
    snr = sqnr_db(ref, got)
    assert snr >= MODEL_SNR_FLOOR_DB[name][bits], f"{name} at {bits} bits: {snr:.1f} dB"
    assert torch.isfinite(got).all()


def test_channels_last_resnet_stores_what_a_contiguous_one_does() -> None:
    # A CNN trained in channels_last saves its activations permuted; every op rule stores them in memory
    # order (NOTE [ Normalised records in memory order ]), so the same tensors are compressed to the same
    # bytes, with the same gradient error (SNR floor as test_gradient_snr's at 2 bits). The exception: a
    # batch norm input whose planes hold a multiple of 256 values is quantized as it is when contiguous
    # (NOTE [ Normalising only where groups straddle statistics ]), while in channels_last its groups span
    # channels and it is normalised, adding a float32 mean and std per channel.
    model, loss_fn = _resnet()
    ref = _grads(model, loss_fn, None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stats, not_stored = [], []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        model.to(memory_format=memory_format)
        ctx = daftrain.compress(bits=2, model=model, min_numel=1024, seed=2)
        with statistics_not_stored() as skipped:
            got = _grads(model, loss_fn, ctx)
        not_stored.append(sum(skipped))
        model.load_state_dict(state)
        assert sqnr_db(ref, got) >= MODEL_SNR_FLOOR_DB["resnet"][2]
        stats.append(ctx.stats)
    contiguous, channels_last = stats
    assert channels_last.kept_reasons == contiguous.kept_reasons
    assert not_stored[0] > 0 and not_stored[1] == 0
    assert channels_last.packed_bytes == contiguous.packed_bytes + not_stored[0] and contiguous.ratio > 8
