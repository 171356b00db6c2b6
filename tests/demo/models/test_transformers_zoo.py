"""Tests for the randomly initialised Hugging Face model builders (tiny configs)."""

from __future__ import annotations

import pytest
import torch

# Import at collection time: transformers' import costs seconds on a small CPU.
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from daftrain.budget.memory import SavedBytesCounter  # noqa: E402
from daftrain.demo.models.transformers_zoo import (  # noqa: E402
    bert_classifier,
    gpt2_lm,
    roberta_classifier,
    with_lora,
)

# peft 0.21 calls transformers' deprecated `is_gradient_checkpointing` (5.x).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

H, LAYERS, HEADS, FF, VOCAB, POS = 32, 2, 2, 64, 101, 64


def _tiny_gpt2(**kw: object) -> transformers.GPT2LMHeadModel:
    return gpt2_lm(n_layer=LAYERS, n_embd=H, n_head=HEADS, n_positions=POS, vocab_size=VOCAB, seed=0, **kw)


def _tiny_encoder_kwargs() -> dict[str, int]:
    return dict(
        num_labels=3,
        num_hidden_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        intermediate_size=FF,
        vocab_size=VOCAB,
        max_position_embeddings=POS,
        seed=0,
    )


def _ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    # Avoid ids 0..2 (RoBERTa's <s>, <pad>, </s>) so no position is treated as padding.
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_gpt2_forward_backward() -> None:
    model = _tiny_gpt2()
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert model.config._attn_implementation == "eager"
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, VOCAB)
    assert out.past_key_values is None  # use_cache=False: no K/V kept by the output
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_gpt2_defaults_are_gpt2_small() -> None:
    with torch.device("meta"):
        model = gpt2_lm()
    cfg = model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions, cfg.vocab_size) == (12, 768, 12, 1024, 50257)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


@pytest.mark.parametrize("builder", [bert_classifier, roberta_classifier])
def test_encoder_classifier_forward_backward(builder) -> None:  # type: ignore[no-untyped-def]
    model = builder(**_tiny_encoder_kwargs())
    assert model.config._attn_implementation == "eager"
    out = model(input_ids=_ids(), labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3)
    out.loss.backward()
    assert all(p.grad is not None for p in model.classifier.parameters())


def test_encoder_defaults_are_base_size() -> None:
    with torch.device("meta"):
        bert = bert_classifier()
        roberta = roberta_classifier()
    assert sum(p.numel() for p in bert.parameters()) == 109_483_778
    assert sum(p.numel() for p in roberta.parameters()) == 124_647_170
    assert isinstance(bert, transformers.BertForSequenceClassification)
    assert isinstance(roberta, transformers.RobertaForSequenceClassification)


def test_seed_reproducible_and_global_rng_untouched() -> None:
    state = torch.random.get_rng_state()
    a, b = _tiny_gpt2(), _tiny_gpt2()
    assert torch.equal(torch.random.get_rng_state(), state)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_lora_gpt2_only_lora_trainable() -> None:
    r = 4
    model = with_lora(_tiny_gpt2(), r=r)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # Per layer: c_attn (H -> 3H), attn.c_proj (H -> H), mlp.c_proj (4H -> H).
    expected = LAYERS * r * ((H + 3 * H) + (H + H) + (4 * H + H))
    assert sum(p.numel() for p in trainable.values()) == expected
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n


@pytest.mark.parametrize("builder", [bert_classifier, roberta_classifier])
def test_lora_encoders_target_query_value(builder) -> None:  # type: ignore[no-untyped-def]
    r = 2
    model = with_lora(builder(**_tiny_encoder_kwargs()), r=r)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(".query." in n or ".value." in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) == LAYERS * 2 * r * (2 * H)
    model(input_ids=_ids(), labels=torch.tensor([1, 0])).loss.backward()


def test_lora_custom_targets_and_unknown_model() -> None:
    model = with_lora(_tiny_gpt2(), r=2, target_modules=["c_fc"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".c_fc.lora_" in n for n in names)
    with pytest.raises(ValueError, match="target_modules"):
        with_lora(torch.nn.Linear(4, 4))


def test_eager_attention_saves_more_than_sdpa() -> None:
    # Eager attention keeps the softmax probabilities (batch*heads*seq^2 per
    # layer) for backward; SDPA's fused kernel keeps only O(seq) statistics.
    # dropout=0: on CPU, SDPA with attention dropout falls back to the math
    # path and saves exactly what eager does.
    ids = _ids(seq=POS)
    saved = {}
    for impl in ("eager", "sdpa"):
        model = _tiny_gpt2(attn_implementation=impl, dropout=0.0)
        with SavedBytesCounter() as counter:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        saved[impl] = counter.saved_bytes
    probs_bytes = LAYERS * 2 * HEADS * POS * POS * 4  # float32 attention probabilities
    assert saved["eager"] - saved["sdpa"] >= probs_bytes // 2
