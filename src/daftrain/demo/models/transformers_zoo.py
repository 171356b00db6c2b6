"""Randomly initialised Hugging Face models built from configs (no network).

Defaults reproduce the published "base/small" architectures (GPT-2 small,
BERT-base, RoBERTa-base) with random weights; pass smaller sizes for tests.
Nothing here downloads weights or tokenizers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
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


# NOTE [ Tiny zoo ]
# ``TINY_ZOO`` lists Hugging Face architectures built from tiny configs (hidden 64, 2 layers, 4 heads,
# default dropout, default attention implementation) for ``benchmarks/bench_zoo.py`` and
# ``tests/saved/test_zoo.py``. Each entry is ``(model_type, input kind, config overrides)``; the
# overrides are applied over ``_TINY_COMMON`` (names that configs do not use are ignored by them; an
# override of ``None`` drops a common name the config rejects).
_TINY_COMMON: dict[str, object] = {
    "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128, "head_dim": 16,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "n_inner": 128, "d_model": 64,
    "num_layers": 2, "num_heads": 4, "d_ff": 128, "d_kv": 16, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
}
_VISION: dict[str, object] = {"image_size": 32, "patch_size": 4, "num_channels": 3}
_CNN: dict[str, object] = {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16, "num_channels": 3}
# Hierarchical vision transformers (Swin and its kin) take a list of heads per stage and check that no
# ``head_dim`` is set beside their ``embed_dim``.
_SWIN: dict[str, object] = {"image_size": 32, "num_channels": 3, "patch_size": 2, "embed_dim": 16, "depths": [1, 1],
                            "num_heads": [1, 2], "window_size": 4, "head_dim": None, "hidden_size": None,
                            "num_hidden_layers": None, "num_attention_heads": None}
_AUDIO: dict[str, object] = {"conv_dim": [32, 32, 32], "conv_stride": [5, 2, 2], "conv_kernel": [10, 3, 3],
                             "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4}

TINY_ZOO: tuple[tuple[str, str, dict[str, object]], ...] = (
    # decoders
    ("gpt2", "text", {}), ("gpt_neo", "text", {"attention_types": [[["global", "local"], 1]], "window_size": 16}),
    ("gptj", "text", {"rotary_dim": 8}), ("gpt_neox", "text", {}), ("opt", "text", {"ffn_dim": 128,
                                                                                     "word_embed_proj_dim": 64}),
    ("bloom", "text", {}), ("llama", "text", {}), ("mistral", "text", {}), ("mixtral", "text", {}),
    ("qwen2", "text", {}), ("qwen3", "text", {}),
    ("qwen3_moe", "text", {"moe_intermediate_size": 32, "num_experts": 8}),
    ("gemma", "text", {}), ("gemma2", "text", {}), ("gemma3_text", "text", {}), ("olmo", "text", {}),
    ("olmo2", "text", {}), ("phi", "text", {}), ("phi3", "text", {}),
    ("falcon", "text", {"head_dim": None}), ("mpt", "text", {"expansion_ratio": 2}), ("stablelm", "text", {}),
    ("starcoder2", "text", {}),
    ("cohere", "text", {}), ("granite", "text", {}), ("codegen", "text", {"rotary_dim": 8}),
    ("biogpt", "text", {}), ("xglm", "text", {"ffn_dim": 128}), ("gpt_bigcode", "text", {}),
    ("persimmon", "text", {}), ("glm", "text", {}), ("helium", "text", {}), ("smollm3", "text", {}),
    ("qwen2_moe", "text", {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4}),
    ("olmoe", "text", {"num_experts": 4, "num_experts_per_tok": 2}),
    ("jetmoe", "text", {"kv_channels": 16, "num_local_experts": 4}), ("granitemoe", "text", {"num_local_experts": 4}),
    ("phimoe", "text", {"num_local_experts": 4}), ("nemotron", "text", {}),
    ("gpt_oss", "text", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                         "layer_types": ["sliding_attention", "full_attention"]}),
    ("cohere2", "text", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}),
    ("deepseek_v3", "text", {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                             "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                             "head_dim": None}),
    ("glm4", "text", {}), ("openai-gpt", "text", {}), ("ctrl", "text", {}), ("lfm2", "text", {}),
    ("recurrent_gemma", "text", {"lru_width": 64, "attention_window_size": 16,
                                 "block_types": ["recurrent", "attention"]}),
    # encoders
    ("bert", "text", {}), ("roberta", "text", {}), ("albert", "text", {"embedding_size": 32}),
    ("distilbert", "text", {"dim": 64, "hidden_dim": 128, "n_layers": 2, "n_heads": 4}),
    ("electra", "text", {"embedding_size": 64}), ("deberta", "text", {}), ("deberta-v2", "text", {}),
    ("xlm-roberta", "text", {}), ("camembert", "text", {}), ("mpnet", "text", {}), ("roformer", "text", {}),
    ("convbert", "text", {}), ("mobilebert", "text", {"embedding_size": 32, "intra_bottleneck_size": 32,
                                                      "true_hidden_size": 32, "num_feedforward_networks": 1}),
    ("squeezebert", "text", {"embedding_size": 64}), ("layoutlm", "text", {}), ("megatron-bert", "text", {}),
    ("ernie", "text", {}), ("rembert", "text", {"input_embedding_size": 64, "output_embedding_size": 64}),
    ("canine", "text", {"downsampling_rate": 2}), ("modernbert", "text", {}), ("yoso", "text", {}),
    ("longformer", "text", {"attention_window": 8}), ("big_bird", "text", {"attention_type": "original_full"}),
    ("nystromformer", "text", {"num_landmarks": 8, "segment_means_seq_len": 64}), ("fnet", "text", {}),
    ("funnel", "text", {"block_sizes": [1, 1], "block_repeats": [1, 1], "d_head": 16, "d_inner": 128,
                        "num_decoder_layers": 1, "num_hidden_layers": None, "architectures": ["FunnelModel"]}),
    ("xlnet", "text", {"d_inner": 128, "d_head": None, "max_position_embeddings": None}),
    ("xmod", "text", {"languages": ["en_XX"], "default_language": "en_XX"}),
    ("ibert", "text", {}), ("luke", "text", {"entity_vocab_size": 16, "entity_emb_size": 32}), ("mra", "text", {}),
    # encoder-decoders
    ("t5", "seq2seq", {}), ("mt5", "seq2seq", {}), ("bart", "seq2seq", {}), ("mbart", "seq2seq", {}),
    ("marian", "seq2seq", {}), ("pegasus", "seq2seq", {}), ("blenderbot", "seq2seq", {}),
    ("m2m_100", "seq2seq", {}), ("led", "seq2seq", {"attention_window": 8}),
    # vision transformers
    ("vit", "image", _VISION), ("deit", "image", _VISION), ("beit", "image", _VISION),
    ("vit_mae", "image", {**_VISION, "mask_ratio": 0.5}), ("dinov2", "image", _VISION),
    ("data2vec-vision", "image", _VISION),
    ("yolos", "image", {**_VISION, "image_size": [32, 32], "num_detection_tokens": 4}),
    ("mobilevit", "image", {"image_size": 32, "hidden_sizes": [32, 48, 64], "neck_hidden_sizes": [8, 8, 16, 16,
                                                                                                 32, 32, 64]}),
    ("vit_msn", "image", _VISION), ("dinov2_with_registers", "image", _VISION),
    ("siglip_vision_model", "image", _VISION), ("clip_vision_model", "image", _VISION),
    ("levit", "image", {"image_size": 32, "hidden_sizes": [32, 48, 64], "num_attention_heads": [1, 2, 2],
                        "depths": [1, 1, 1], "key_dim": [8, 8, 8]}),
    ("pvt", "image", {"image_size": 32, "hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2,
                      "sequence_reduction_ratios": [2, 1], "num_attention_heads": [1, 2], "patch_sizes": [4, 2],
                      "strides": [4, 2], "mlp_ratios": [2, 2]}),
    ("segformer", "image", {"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2, "sr_ratios": [2, 1],
                            "num_attention_heads": [1, 2], "patch_sizes": [7, 3], "strides": [4, 2],
                            "mlp_ratios": [2, 2]}),
    ("swiftformer", "image", {"embed_dims": [16, 32, 48, 64], "depths": [1, 1, 1, 1]}),
    ("swin", "image", _SWIN), ("swinv2", "image", _SWIN), ("donut-swin", "image", _SWIN),
    ("focalnet", "image", {**_SWIN, "focal_levels": [2, 2], "focal_windows": [3, 3], "num_heads": None}),
    ("hiera", "image", {**_SWIN, "image_size": [32, 32], "patch_size": [3, 3], "patch_stride": [2, 2],
                        "patch_padding": [1, 1], "embed_dim_multiplier": 2.0, "num_query_pool": 1,
                        "query_stride": [2, 2], "masked_unit_size": [4, 4], "masked_unit_attention": [True, False]}),
    ("mobilevitv2", "image", {"image_size": 64, "width_multiplier": 0.25}),
    # CNNs
    ("resnet", "image", {**_CNN, "layer_type": "basic"}), ("convnext", "image", {**_CNN, "hidden_sizes": [16, 32]}),
    ("convnextv2", "image", _CNN),
    ("mobilenet_v1", "image", {"image_size": 32, "depth_multiplier": 0.25}),
    ("mobilenet_v2", "image", {"image_size": 32, "depth_multiplier": 0.25}),
    ("poolformer", "image", {"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2,
                             "patch_sizes": [7, 3], "strides": [4, 2], "padding": [2, 1]}),
    # audio
    ("wav2vec2", "audio", _AUDIO), ("hubert", "audio", _AUDIO), ("data2vec-audio", "audio", _AUDIO),
    ("sew", "audio", _AUDIO), ("sew-d", "audio", _AUDIO), ("unispeech", "audio", _AUDIO), ("wavlm", "audio", _AUDIO),
    ("unispeech-sat", "audio", _AUDIO),
    ("wav2vec2-conformer", "audio", {**_AUDIO, "position_embeddings_type": "relative"}),
    ("whisper", "speech_seq2seq", {"num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 32}),
    # recurrent / state space
    ("mamba", "text", {"state_size": 8, "expand": 2}), ("rwkv", "text", {"attention_hidden_size": 64}),
    ("falcon_mamba", "text", {"state_size": 8, "expand": 2}),
    ("mamba2", "text", {"num_heads": 8, "head_dim": 16, "state_size": 8, "expand": 2, "n_groups": 1,
                        "chunk_size": 16}),
    ("jamba", "text", {"num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                       "mamba_d_state": 8}),
    ("bamba", "text", {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 16,
                       "attn_layer_indices": [1]}),
)


def tiny_model(model_type: str, overrides: dict[str, object] | None = None, *, seed: int = 0) -> nn.Module:
    """The base model of ``model_type`` from a tiny config (``NOTE [ Tiny zoo ]``), in train mode."""
    from transformers import AutoConfig, AutoModel

    kwargs = {k: v for k, v in {**_TINY_COMMON, **(overrides or {})}.items() if v is not None}
    config = AutoConfig.for_model(model_type, **kwargs)
    with _seeded(seed):
        model = AutoModel.from_config(config)
    return model.train()


def tiny_inputs(model: nn.Module, kind: str, *, batch: int = 4, length: int = 64,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of ``kind`` (``text``, ``seq2seq``, ``image``, ``audio``, ``speech_seq2seq``) for ``model``."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    vocab = int(getattr(config, "vocab_size", 128) or 128)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    if kind == "text":
        return {"input_ids": ids}
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(3, vocab, (batch, length // 2), generator=gen)}
    if kind == "image":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        return {"pixel_values": torch.randn(batch, getattr(config, "num_channels", 3), size, size, generator=gen)}
    if kind == "audio":
        return {"input_values": torch.randn(batch, 4000, generator=gen)}
    if kind == "speech_seq2seq":
        frames = 2 * int(config.max_source_positions)
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=gen),
                "decoder_input_ids": torch.randint(3, vocab, (batch, 8), generator=gen)}
    raise InvalidArgumentError(f"kind must be text, seq2seq, image, audio or speech_seq2seq, got {kind!r}")


def _projection_loss(out: object) -> torch.Tensor:
    values = out.values() if hasattr(out, "values") else out  # type: ignore[attr-defined]
    y = next(v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad)
    proj = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype).to(y.device)
    return (y * proj).sum()


def zoo_gradient(model: nn.Module, inputs: dict[str, torch.Tensor],
                 ctx: contextlib.AbstractContextManager[object] | None = None, *,
                 loss_under_context: bool = False, forward: Callable[..., object] | None = None,
                 after_forward: Callable[[], object] | None = None) -> torch.Tensor:
    """All parameter gradients, as one float64 vector, of a fixed random projection of the model's first
    float output, with the forward under ``ctx`` and the same dropout masks in every run: what the zoo
    benchmark and tests compare between plain PyTorch and daftrain (the speech models draw their
    SpecAugment masks from numpy's global generator, seeded too). With ``loss_under_context`` the loss is
    computed inside ``ctx`` too, where ``compress(bits="auto", error_share=...)`` calibrates on it.
    ``forward`` runs the model instead of calling it (``torch.compile(model)``); ``after_forward`` is called
    inside ``ctx`` once the model's forward has run, before the loss."""
    import numpy as np

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    np.random.seed(1234)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = (model if forward is None else forward)(**inputs)
        if after_forward is not None:
            after_forward()
        if loss_under_context:
            loss = _projection_loss(out)
    if not loss_under_context:
        loss = _projection_loss(out)
    loss.backward()
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    return torch.cat([(torch.view_as_real(g) if g.is_complex() else g).reshape(-1).double() for g in grads])
