"""Small saved tensors packed together: a recurrent model's memory, step time and gradient, kept against packed.

``nn.GRU`` on the CPU (and an RNN cell run in a Python loop) saves a few tensors of batch x hidden values per
time step and layer: thousands per forward, each under ``min_numel``. Configurations: ``plain`` PyTorch;
``bits4+kept`` (``compress(bits=4, batch_small=False)``: the small tensors kept exact); ``bits4`` and
``bits2`` (the default: packed together, ``NOTE [ Small tensors packed together ]``); ``bits4+alone``
(``min_numel=256``: each small tensor quantized on its own). Per configuration, a fresh process: the peak
RSS over the steps above the RSS once model and batch exist (VmHWM, reset after the warm-up steps), the
saved-bytes ratio, the gradient's cosine to plain's on the same batch, and the step time; ``--rounds`` rounds
of fresh processes, configurations interleaved in each, medians over the steps after the first two. The
load average is read at each process's start.

    flock /tmp/daftrain-bench.lock python benchmarks/bench_small_tensors.py [--rounds 3] [--steps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import median, write_json
from torch import nn

CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "bits4+kept": {"bits": 4, "batch_small": False},
    "bits4": {"bits": 4},
    "bits2": {"bits": 2},
    "bits4+alone": {"bits": 4, "min_numel": 256},
}


class _CellLM(nn.Module):
    """An LSTM cell run over the sequence in Python, as custom recurrent code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.cell = nn.LSTMCell(64, 128)
        self.head = nn.Linear(128, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[0], 128)
        outs = []
        for step in self.embed(x).unbind(1):
            h, c = self.cell(step, (h, c))
            outs.append(h)
        return self.head(torch.stack(outs, 1))


class _GRULM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.rnn = nn.GRU(64, 128, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(256, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


MODELS = {"gru": _GRULM, "lstm_cell": _CellLM}
"""Batch 16 x 100 tokens each."""


def _worker(model_name: str, config_name: str, steps: int) -> dict[str, Any]:
    import daftrain
    from daftrain.rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    torch.manual_seed(0)
    model = MODELS[model_name]()
    x = torch.randint(0, 100, (16, 100), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 100, (16, 100), generator=torch.Generator().manual_seed(2))
    config = CONFIGS[config_name]
    ctx = daftrain.compress(**config) if config is not None else None

    def step(ctx: daftrain.compress | None) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if ctx is None:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        else:
            with ctx:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    ref = step(None) if ctx is not None else None  # plain's gradient on the same batch, before anything is measured
    baseline = current_rss_bytes()
    times, grads = [], None
    for i in range(steps):
        if i == 2:
            reset_peak_rss()
        start = time.perf_counter()
        grads = step(ctx)
        times.append(time.perf_counter() - start)
    assert grads is not None
    row: dict[str, Any] = {
        "model": model_name, "config": config_name, "load_average": os.getloadavg()[0],
        "step_s": median(times[2:]), "first_step_s": times[0],
        "peak_above_baseline_mb": (peak_rss_bytes() - baseline) / 1e6,
    }
    if ctx is not None:
        stats = ctx.stats
        row.update(ratio=stats.ratio, raw_mb=stats.raw_bytes / 1e6, stored_mb=stats.stored_bytes / 1e6,
                   batched=stats.batched, seen=stats.tensors_seen, kept=stats.kept,
                   cos=float(F.cosine_similarity(grads.double(), ref.double(), dim=0)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/small_tensors.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker, args.steps)))
        return
    rows = []
    for round_ in range(args.rounds):
        for model in args.models.split(","):
            for config in args.configs.split(","):
                out = subprocess.run([sys.executable, __file__, "--worker", model, config, "--steps", str(args.steps)],
                                     check=True, capture_output=True, text=True).stdout
                row = {"round": round_, **json.loads(out.strip().splitlines()[-1])}
                rows.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    summary: dict[str, Any] = {}
    for model in args.models.split(","):
        plain = median([r["step_s"] for r in rows if r["model"] == model and r["config"] == "plain"])
        plain_peak = median([r["peak_above_baseline_mb"] for r in rows if r["model"] == model
                             and r["config"] == "plain"])
        for config in args.configs.split(","):
            mine = [r for r in rows if r["model"] == model and r["config"] == config]
            peak = median([r["peak_above_baseline_mb"] for r in mine])
            entry = {"step_s": median([r["step_s"] for r in mine]),
                     "step_vs_plain": median([r["step_s"] for r in mine]) / plain,
                     "peak_above_baseline_mb": peak, "peak_less_than_plain": plain_peak / max(peak, 1e-9)}
            if config != "plain":
                entry.update(ratio=median([r["ratio"] for r in mine]), cos=median([r["cos"] for r in mine]))
            summary[f"{model}/{config}"] = entry
            print(model, config, {k: round(v, 4) for k, v in entry.items()})
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
