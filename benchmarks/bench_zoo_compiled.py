"""``compress`` inside ``torch.compile``d models: gradient cosine against the same model compiled alone.

For each architecture of ``--models`` (a sample of the zoo by default: decoders with and without QK-norm,
encoders, ViTs with class tokens, CNNs with BatchNorm and ReLU6, a speech encoder, a state-space model;
the ``torch.nn`` ones by their ``TORCH_ZOO`` names), with every dropout module, dropout rate and
stochastic depth (drop path) rate at 0 (a compiled graph draws its masks from other random streams than
eager code, and compressing adds draws of its own): the gradient of ``bench_zoo.py``'s loss of the model
compiled alone (``--backend``, inductor by default) and compiled under ``compress(bits=b)`` for each ``b``
of ``--bits``, and the eager ``compress(bits=b)`` against eager plain PyTorch beside it. Reported per
model and width: both cosines,
the saved tensors each compiled graph stored quantized / bit-packed / kept, and its saved-bytes ratio
(``ctx.stats.compiled_*``). The rules the traced pack applies are ``NOTE [ Op rules in compiled graphs ]``.

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_zoo_compiled.py
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
from common import build_zoo_model, measured, recorded, write_json, zoo_entries

import daftrain
from daftrain.demo.models.transformers_zoo import zoo_gradient

SAMPLE = ("gpt2", "llama", "qwen3", "gemma3_text", "bert", "t5", "deit", "beit", "convnext", "mobilenet_v2",
          "wav2vec2", "mamba", "mobile_cnn:channels_last", "unet:channels_last")


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def run_model(name: str, kind: str, overrides: dict[str, Any], widths: list[int], backend: str,
              keep_dropout: bool = False) -> dict:
    row: dict[str, Any] = {"model": name}
    with recorded(row):
        model, inputs = build_zoo_model(name, kind, overrides)
        for module in model.modules() if not keep_dropout else ():
            if "Dropout" in type(module).__name__ and isinstance(getattr(module, "p", None), float):
                module.p = 0.0  # nn.Dropout, Dropout1d/2d/3d, AlphaDropout
            for attribute, value in vars(module).items():  # rates passed to F.dropout (T5's attention), drop paths
                if ("dropout" in attribute or "drop_prob" in attribute) and isinstance(value, float):
                    setattr(module, attribute, 0.0)
        eager = zoo_gradient(model, inputs)
        torch._dynamo.reset()
        compiled = zoo_gradient(model, inputs, forward=torch.compile(model, backend=backend))
        for b in widths:
            ctx = daftrain.compress(bits=b, model=model)
            eager_b = zoo_gradient(model, inputs, ctx)
            torch._dynamo.reset()
            ctx = daftrain.compress(bits=b, model=model)
            compiled_b = zoo_gradient(model, inputs, ctx, forward=torch.compile(model, backend=backend))
            s = ctx.stats
            row[f"bits{b}"] = {
                "eager_cos": _cos(eager_b, eager), "compiled_cos": _cos(compiled_b, compiled),
                "finite": bool(torch.isfinite(compiled_b).all()), "graphs": s.compiled_graphs,
                "saved": s.compiled_saved, "quantized": s.compiled_quantized, "bool_packed": s.compiled_bool_packed,
                "ratio": s.compiled_raw_bytes / max(1, s.compiled_stored_bytes)}
    return row


def summarize(rows: list[dict], widths: list[int]) -> dict:
    ok, out = measured(rows)
    for b in widths:
        key = f"bits{b}"
        out[key] = {
            "compiled_min": min(r[key]["compiled_cos"] for r in ok),
            "compiled_median": statistics.median(r[key]["compiled_cos"] for r in ok),
            "eager_min": min(r[key]["eager_cos"] for r in ok),
            "not_finite": [r["model"] for r in ok if not r[key]["finite"]],
            "ratio_median": statistics.median(r[key]["ratio"] for r in ok),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SAMPLE), help="zoo model types (default: SAMPLE)")
    parser.add_argument("--bits", type=int, nargs="*", default=[8, 4])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--keep-dropout", action="store_true",
                        help="leave dropout and drop paths on (compress must not change compiled masks)")
    parser.add_argument("--out", default="benchmarks/results/zoo_compiled.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    entries = {m: (k, o) for m, k, o in zoo_entries("transformers") + zoo_entries("torch")}
    rows = []
    for name in args.models:
        row = run_model(name, *entries[name], args.bits, args.backend, args.keep_dropout)
        rows.append(row)
        print(row["model"], row["status"], row.get("error", ""), {
            k: f"compiled {v['compiled_cos']:.4f} eager {v['eager_cos']:.4f} {v['quantized']}+{v['bool_packed']}"
               f"/{v['saved']} {v['ratio']:.1f}x" for k, v in row.items() if k.startswith("bits")}, flush=True)
    summary = summarize(rows, args.bits)
    print(summary)
    write_json(args.out, {"command": "flock /tmp/daftrain-bench.lock .venv/bin/python "
                          "benchmarks/bench_zoo_compiled.py " + " ".join(sys.argv[1:]),
                          "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
