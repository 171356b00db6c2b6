"""``bits="auto"`` against uniform bits at the same bytes, over the zoo of tiny Hugging Face architectures.

For each architecture of ``TINY_ZOO`` and each width ``b`` of ``--bits`` (default 4 and 2): the gradient
of ``bench_zoo.py``'s loss in plain PyTorch, under ``compress(bits=b)`` and under ``compress(bits="auto",
avg_bits=b)``, each on its second step (auto's first is the adaptation step that estimates importance;
fixed bits run a first step too, so that both are measured on the same rounding draws: where the
allocation is uniform the two gradients are then identical), each over ``--draws`` rounding seeds.
Reported per model and width: the mean gradient error ``1 - cosine`` of each, their ratio (auto over
uniform; below 1 is better), and the stored bytes of each. Issue 17 asks that auto never do worse than
uniform bits at the same bytes; a model counts as worse where auto's mean error exceeds uniform's by more
than the spread of the draws allows (``NOISE``, below).

``--zoo torch`` runs the ``torch.nn`` architectures of ``demo/models/torch_zoo.py`` instead (recurrent,
``nn.Transformer``, encoder-decoder CNN, MLP-Mixer, recommender, complex spectral operator, each also
under bfloat16 autocast), with the same loss.

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_zoo_auto.py
    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_zoo_auto.py --zoo torch \
        --out benchmarks/results/zoo_auto_torch.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ZOOS, build_zoo_model, measured, recorded, write_json, zoo_entries

import daftrain
from daftrain.demo.models.transformers_zoo import zoo_gradient

NOISE = 1.1
"""Auto counts as worse where its mean error is above ``NOISE`` times uniform's: the mean over the draws
of one configuration varies by a few per cent between sets of seeds on these models."""


def _error(grad: torch.Tensor, ref: torch.Tensor) -> float:
    return 1.0 - float(torch.nn.functional.cosine_similarity(grad, ref, dim=0))


def run_model(model_type: str, kind: str, overrides: dict[str, Any], widths: list[int], draws: int) -> dict:
    row: dict[str, Any] = {"model": model_type, "kind": kind}
    with recorded(row):
        model, inputs = build_zoo_model(model_type, kind, overrides)
        ref = zoo_gradient(model, inputs)
        for b in widths:
            fixed, auto, fixed_bytes, auto_bytes = [], [], 0, 0
            for seed in range(draws):
                ctx = daftrain.compress(bits=b, model=model, seed=seed)
                zoo_gradient(model, inputs, ctx)  # a first step, as auto's adaptation step: the same draws
                fixed.append(_error(zoo_gradient(model, inputs, ctx), ref))
                fixed_bytes = ctx.stats.stored_bytes
                ctx = daftrain.compress(bits="auto", avg_bits=float(b), model=model, seed=seed)
                zoo_gradient(model, inputs, ctx)  # the adaptation step
                auto.append(_error(zoo_gradient(model, inputs, ctx), ref))
                auto_bytes = ctx.stats.stored_bytes
            f, a = statistics.mean(fixed), statistics.mean(auto)
            row[f"bits{b}"] = {"fixed_error": f, "auto_error": a, "auto_over_fixed": a / f if f > 0 else None,
                               "fixed_errors": fixed, "auto_errors": auto,
                               "fixed_bytes": fixed_bytes, "auto_bytes": auto_bytes}
    return row


def summarize(rows: list[dict], widths: list[int]) -> dict:
    ok, out = measured(rows)
    for b in widths:
        key = f"bits{b}"
        ratios = [r[key]["auto_over_fixed"] for r in ok if r[key]["auto_over_fixed"] is not None]
        worse = [r["model"] for r in ok if r[key]["auto_error"] > NOISE * r[key]["fixed_error"]]
        over_bytes = [r["model"] for r in ok if r[key]["auto_bytes"] > r[key]["fixed_bytes"]]
        out[key] = {"auto_over_fixed_median": statistics.median(ratios), "auto_over_fixed_max": max(ratios),
                    "worse": worse, "more_bytes": over_bytes, "better": sum(x < 1 for x in ratios),
                    "total": len(ratios)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", choices=ZOOS, default="transformers",
                        help="the Hugging Face zoo (TINY_ZOO) or the torch.nn one (TORCH_ZOO)")
    parser.add_argument("--models", nargs="*", help="model types (default: the whole zoo)")
    parser.add_argument("--bits", type=int, nargs="*", default=[4, 2])
    parser.add_argument("--draws", type=int, default=2, help="rounding seeds per configuration (default 2)")
    parser.add_argument("--out", default="benchmarks/results/zoo_auto.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for model_type, kind, overrides in (z for z in zoo_entries(args.zoo) if not args.models or z[0] in args.models):
        row = run_model(model_type, kind, overrides, args.bits, args.draws)
        rows.append(row)
        print(row["model"], row["status"], row.get("error", ""), {
            k: f"fixed {v['fixed_error']:.4f} auto {v['auto_error']:.4f} "
               f"({'n/a' if v['auto_over_fixed'] is None else format(v['auto_over_fixed'], '.2f')}x) "
               f"bytes {v['auto_bytes'] / max(1, v['fixed_bytes']):.3f}x"
            for k, v in row.items() if k.startswith("bits")}, flush=True)
    summary = summarize(rows, args.bits)
    print(summary)
    write_json(args.out, {"command": "flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_zoo_auto.py "
                          + " ".join(sys.argv[1:]), "noise": NOISE, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
