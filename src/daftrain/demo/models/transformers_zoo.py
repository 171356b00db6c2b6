"""Randomly initialised Hugging Face models built from configs (no network).

Defaults reproduce the published "base/small" architectures (GPT-2 small,
BERT-base, RoBERTa-base) with random weights; pass smaller sizes for tests.
Nothing here downloads weights or tokenizers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...errors import InvalidArgumentError

if TYPE_CHECKING:
    from transformers import (
        BertForSequenceClassification,
        GPT2LMHeadModel,
        RobertaForSequenceClassification,
    )

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "bert_classifier",
    "gpt2_lm",
    "roberta_classifier",
    "with_lora",
]

# NOTE [ Eager attention by default ]
# The builders default to ``attn_implementation="eager"``: eager attention
# materialises softmax(QK^T) and keeps it (plus a dropout mask) for backward,
# i.e. O(batch * heads * seq^2) saved bytes, which is what many real training
# set-ups (older models, custom masks, output_attentions=True) pay. SDPA/flash
# kernels instead save only O(seq) statistics. Pass ``attn_implementation=
# "sdpa"`` to measure the fused path.

# Mapping from ``config.model_type`` to default LoRA target module names.
# (Immutable so it is not global mutable state.)
DEFAULT_LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj"),
    "bert": ("query", "value"),
    "roberta": ("query", "value"),
}


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Seed the CPU RNG inside the block without changing the caller's RNG state."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def gpt2_lm(
    n_layer: int = 12,
    n_embd: int = 768,
    n_head: int = 12,
    n_positions: int = 1024,
    vocab_size: int = 50257,
    dropout: float = 0.1,
    *,
    attn_implementation: str = "eager",
    seed: int | None = None,
) -> GPT2LMHeadModel:
    """Randomly initialised ``GPT2LMHeadModel`` (defaults: GPT-2 small, 124M params).

    ``dropout`` sets the residual, embedding and attention dropout. The KV cache
    is disabled (``use_cache=False``) since these models are built for training.
    ``seed`` (optional) makes the initialisation reproducible without touching
    the global RNG state.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    # NOTE [ Special token ids for tiny vocabularies ]
    # GPT2Config defaults bos/eos to 50256; transformers 5.x warns when they
    # fall outside a smaller test vocabulary, so clamp them into range.
    special = min(50256, vocab_size - 1)
    # NOTE [ use_cache=False ]
    # With use_cache=True a training forward also returns past_key_values,
    # keeping every layer's K and V alive through the output object; that is
    # not an activation saved for backward and would pollute memory numbers.
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab_size,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=special,
        eos_token_id=special,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    with _seeded(seed):
        return GPT2LMHeadModel(config)


def bert_classifier(
    num_labels: int = 2,
    num_hidden_layers: int = 12,
    hidden_size: int = 768,
    num_attention_heads: int = 12,
    intermediate_size: int = 3072,
    vocab_size: int = 30522,
    max_position_embeddings: int = 512,
    dropout: float = 0.1,
    *,
    attn_implementation: str = "eager",
    seed: int | None = None,
) -> BertForSequenceClassification:
    """Randomly initialised ``BertForSequenceClassification`` (defaults: BERT-base, ~110M params)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**_encoder_config(num_labels, num_hidden_layers, hidden_size, num_attention_heads,
                                          intermediate_size, vocab_size, max_position_embeddings, dropout,
                                          attn_implementation))
    with _seeded(seed):
        return BertForSequenceClassification(config)


def roberta_classifier(
    num_labels: int = 2,
    num_hidden_layers: int = 12,
    hidden_size: int = 768,
    num_attention_heads: int = 12,
    intermediate_size: int = 3072,
    vocab_size: int = 50265,
    max_position_embeddings: int = 514,
    dropout: float = 0.1,
    *,
    attn_implementation: str = "eager",
    seed: int | None = None,
) -> RobertaForSequenceClassification:
    """Randomly initialised ``RobertaForSequenceClassification`` (defaults: RoBERTa-base, ~125M params).

    RoBERTa's position ids start at ``pad_token_id + 1 = 2``, so sequences can be
    at most ``max_position_embeddings - 2`` tokens long, and token ids 0..2 are
    the special ``<s>``, ``<pad>``, ``</s>`` tokens (id 1 is treated as padding
    when computing position ids).
    """
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(type_vocab_size=1,
                           **_encoder_config(num_labels, num_hidden_layers, hidden_size, num_attention_heads,
                                             intermediate_size, vocab_size, max_position_embeddings, dropout,
                                             attn_implementation))
    with _seeded(seed):
        return RobertaForSequenceClassification(config)


def _encoder_config(num_labels: int, num_hidden_layers: int, hidden_size: int, num_attention_heads: int,
                    intermediate_size: int, vocab_size: int, max_position_embeddings: int, dropout: float,
                    attn_implementation: str) -> dict[str, object]:
    """The config arguments BERT and RoBERTa share."""
    return {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "intermediate_size": intermediate_size,
        "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout,
        "max_position_embeddings": max_position_embeddings, "num_labels": num_labels, "use_cache": False,
        "attn_implementation": attn_implementation,
    }


def with_lora(
    model: nn.Module,
    r: int = 8,
    target_modules: Sequence[str] | None = None,
    *,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    modules_to_save: Sequence[str] | None = None,
) -> nn.Module:
    """Wrap ``model`` with LoRA adapters via ``peft`` and return the ``PeftModel``.

    ``target_modules`` defaults per architecture (``config.model_type``): GPT-2
    ``("c_attn", "c_proj")``, BERT/RoBERTa ``("query", "value")``. Only the
    LoRA matrices (plus ``modules_to_save``, default none) stay trainable.
    ``lora_alpha`` defaults to ``2 * r``.
    """
    from peft import LoraConfig, get_peft_model

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if target_modules is None:
        if model_type not in DEFAULT_LORA_TARGETS:
            raise InvalidArgumentError(
                f"no default LoRA target_modules for model_type={model_type!r}; "
                f"pass target_modules explicitly (known: {sorted(DEFAULT_LORA_TARGETS)})"
            )
        target_modules = DEFAULT_LORA_TARGETS[model_type]
    # NOTE [ GPT-2 Conv1D and fan_in_fan_out ]
    # GPT-2 stores its projections as transformers' Conv1D with the weight laid
    # out (in, out); peft needs fan_in_fan_out=True for them (it warns and flips
    # the flag itself otherwise), so set it up front.
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        fan_in_fan_out=model_type == "gpt2",
        modules_to_save=None if modules_to_save is None else list(modules_to_save),
    )
    return get_peft_model(model, config)
