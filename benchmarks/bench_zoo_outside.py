"""Architectures outside the zoo, tried as a new user would: every model type ``transformers`` registers.

For each model type of ``transformers.CONFIG_MAPPING`` that ``TINY_ZOO`` does not list, the base model is
built from the zoo's tiny overrides (``_TINY_COMMON``, then each family's overrides in turn until one
builds: vision, hierarchical vision, CNN, audio), its input kind read from its ``forward``'s arguments;
a model that does not build, has no kind the zoo feeds, or has more than ``--max-params`` parameters
(a composite config whose sub-configs ignore the overrides) is listed as skipped with the reason. Each
one that runs is measured as ``bench_zoo.py`` measures the zoo, with the same gradient
(``zoo_gradient``): two plain runs, exact mode bit-identical to plain, the gradient cosine at 8, 4 and 2
bits with the saved-bytes ratio, and whether every value is finite; an exception under ``compress`` is a
row's ``error``.

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_zoo_outside.py
    .venv/bin/python benchmarks/bench_zoo_outside.py --models embedding_gemma2_text cpmant --out /tmp/o.json

``--shard i/n`` measures every n-th model type from the i-th (a run split over processes; ``--merge``
joins their JSON files into one).
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_zoo import TARGETS, _cos
from common import ratio_to_plain, recorded, write_json

import daftrain
from daftrain.demo.models import transformers_zoo as tz
from daftrain.demo.models.transformers_zoo import tiny_inputs, tiny_model, zoo_gradient

_FAMILIES: tuple[dict[str, object], ...] = ({}, tz._VISION, tz._SWIN, tz._CNN, {**tz._VISION, **tz._CNN}, tz._AUDIO)


def _kind(model: torch.nn.Module) -> str | None:
    params = inspect.signature(model.forward).parameters
    if "input_ids" in params:
        return "seq2seq" if "decoder_input_ids" in params else "text"
    if "pixel_values" in params:
        return "image"
    if "input_values" in params:
        return "audio"
    if "input_features" in params and "decoder_input_ids" in params:
        return "speech_seq2seq"
    return None


def build(model_type: str, max_params: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
    """The first of the families' tiny configs of ``model_type`` whose model builds and trains in plain PyTorch
    (raises ``LookupError`` naming why none does)."""
    reasons = []
    for family, overrides in enumerate(_FAMILIES):
        try:
            model = tiny_model(model_type, dict(overrides))
            kind = _kind(model)
            params = sum(p.numel() for p in model.parameters())
            if kind is None or params > max_params:
                reasons.append("no input kind the zoo feeds" if kind is None else f"{params} parameters")
                continue
            inputs = tiny_inputs(model, kind)
            zoo_gradient(model, inputs)  # trains in plain PyTorch
            return model, inputs, {"kind": kind, "family": family, "parameters": params}
        except Exception as exc:  # a config or model of transformers' that these overrides do not fit
            reasons.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    raise LookupError(reasons[-1] if reasons else "nothing tried")


def run_model(model_type: str, max_params: int) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model_type}
    try:
        model, inputs, info = build(model_type, max_params)
    except LookupError as exc:
        row.update(status="skipped", reason=str(exc))
        return row
    row.update(info)
    with recorded(row):
        ref = zoo_gradient(model, inputs)
        row["cos_plain"] = _cos(zoo_gradient(model, inputs), ref)
        exact_ctx = daftrain.compress(bits=None, model=model)
        exact = zoo_gradient(model, inputs, exact_ctx)
        row["exact_identical"] = bool(torch.equal(exact, ref))
        plain_bytes = exact_ctx.stats.raw_bytes  # what plain PyTorch saves
        for bits in (8, 4, 2):
            ctx = daftrain.compress(bits=bits, model=model)
            grad = zoo_gradient(model, inputs, ctx)
            row[f"cos{bits}"], row[f"ratio{bits}"] = _cos(grad, ref), ratio_to_plain(plain_bytes, ctx.stats)
            row[f"finite{bits}"] = bool(torch.isfinite(grad).all())
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in rows if r["status"] == "ok"]

    def below(key: str, target: float) -> dict[str, float]:
        return {r["model"]: round(r[key], 4) for r in ran if r[key] < target}

    return {
        "types": len(rows), "ran": len(ran), "skipped": sum(r["status"] == "skipped" for r in rows),
        "errors": {r["model"]: r["error"] for r in rows if r["status"] == "error"},
        "plain_nondeterministic": {r["model"]: round(r["cos_plain"], 4) for r in ran if r["cos_plain"] < 0.9999},
        "exact_not_identical": [r["model"] for r in ran if not r["exact_identical"]],
        "not_finite": [r["model"] for r in ran if not all(r[f"finite{b}"] for b in (8, 4, 2))],
        "bits8_below": below("cos8", TARGETS["bits8_min"]), "bits4_below": below("cos4", TARGETS["bits4_min"]),
        "bits2_below": below("cos2", TARGETS["bits2_min"]),
        "bits2_median": statistics.median(r["cos2"] for r in ran) if ran else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="model types (default: every one outside TINY_ZOO)")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th model type from the i-th")
    parser.add_argument("--max-params", type=int, default=30_000_000)
    parser.add_argument("--max-memory-gb", type=float, default=8.0,
                        help="the process's data limit: a model that would need more raises, as a skipped row")
    parser.add_argument("--merge", nargs="*", help="JSON files of shards to join into --out (nothing is run)")
    parser.add_argument("--out", default="benchmarks/results/zoo_outside.json")
    args = parser.parse_args()
    if args.merge:
        rows = [row for path in args.merge for row in json.loads(Path(path).read_text())["rows"]]
        rows.sort(key=lambda r: r["model"])
        write_json(args.out, {"command": "benchmarks/bench_zoo_outside.py " + " ".join(sys.argv[1:]),
                              "targets": TARGETS, "summary": summarize(rows), "rows": rows})
        return
    limit = int(args.max_memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    logging.set_verbosity_error()
    zoo = {entry[0] for entry in tz.TINY_ZOO}
    types = args.models or sorted(set(CONFIG_MAPPING.keys()) - zoo)
    index, count = (int(x) for x in args.shard.split("/"))
    rows = []
    for model_type in types[index::count]:
        row = run_model(model_type, args.max_params)
        rows.append(row)
        print(row["model"], row["status"], row.get("error", row.get("reason", ""))[:120],
              {k: round(v, 4) for k, v in row.items() if k.startswith("cos")}, flush=True)
    summary = summarize(rows)
    for k, v in summary.items():
        print(f"{k}: {v}")
    write_json(args.out, {"command": "flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_zoo_outside.py "
                          + " ".join(sys.argv[1:]), "targets": TARGETS, "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
