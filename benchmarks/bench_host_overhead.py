"""Host time per saved tensor: what ``compress`` adds to a step for each record it makes, where the
records are small enough that the kernels' own work is a small part of it.

On a GPU the device runs the quantize and decode kernels in microseconds, and what bounds a compressed
step is the host's work per saved tensor (op rules, the decision, the record, the kernel's argument
checks and dispatch, the decode): ``docs/memory.md`` ("On CUDA"). On a CPU the same host work shows
wherever the tensors are small. This benchmark measures it on models of many small saved tensors,
one PyTorch thread, in one process, the configurations interleaved within every round:

* ``mlp64``: 100 blocks of ``Linear(64, 64)`` + ``Tanh``, batch 64 (each saved tensor 4096 values,
  ``CompressionConfig.min_numel``: the smallest that is quantized);
* ``mlp256``: the same at 256 wide, batch 256 (65536 values each);
* ``bert``: a BERT encoder from a tiny config (4 layers of 128, 4 heads), 4 x 64 tokens, eager
  attention: LayerNorm, softmax, GELU and dropout through their op rules.

Per model and configuration (plain PyTorch, exact mode, 4 and 2 bits): the median step time over
``--steps`` steps per round (after two warm-up steps) and ``--rounds`` rounds, and the host time per
saved tensor above plain's step: ``(step - plain) / records``, ``records`` the saved tensors the
4-bit context stored (``ctx.stats``: quantized, bool-packed and kept, shared saves counted once); the
same from the process's CPU time (less moved by other jobs on a shared machine than the wall time).

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_host_overhead.py \
        --out benchmarks/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_json

import daftrain

CONFIGS: dict[str, dict[str, Any] | None] = {"plain": None, "exact": {"bits": None}, "bits4": {"bits": 4},
                                             "bits2": {"bits": 2}}


def mlp(width: int, batch: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(100):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(batch, width)
    return model, lambda: model(x).square().mean()


def bert() -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                        vocab_size=1000, max_position_embeddings=128, attn_implementation="eager")
    model = BertForMaskedLM(config).train()
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Callable[[], torch.Tensor]]]] = {
    "mlp64": lambda: mlp(64, 64), "mlp256": lambda: mlp(256, 256), "bert": bert}


def run_model(name: str, steps: int, rounds: int) -> dict[str, Any]:
    model, loss_fn = MODELS[name]()
    contexts = {c: contextlib.nullcontext() if kw is None else daftrain.compress(model=model, **kw)
                for c, kw in CONFIGS.items()}

    def step(ctx: Any) -> None:
        with ctx:
            loss = loss_fn()
        loss.backward()
        model.zero_grad(set_to_none=True)

    for ctx in contexts.values():
        for _ in range(2):
            step(ctx)
    times: dict[str, list[float]] = {c: [] for c in contexts}
    cpu_times: dict[str, list[float]] = {c: [] for c in contexts}
    for _ in range(rounds):
        for c, ctx in contexts.items():
            for _ in range(steps):
                start, cpu_start = time.perf_counter(), time.process_time()
                step(ctx)
                times[c].append(time.perf_counter() - start)
                cpu_times[c].append(time.process_time() - cpu_start)
    stats = contexts["bits4"].stats
    records = stats.compressed + stats.bool_packed + stats.kept
    med = {c: median(ts) for c, ts in times.items()}
    cpu = {c: median(ts) for c, ts in cpu_times.items()}
    row: dict[str, Any] = {"model": name, "records": records, "quantized": stats.compressed,
                           "step_ms": {c: round(1e3 * t, 3) for c, t in med.items()},
                           "us_per_record": {c: round(1e6 * (t - med["plain"]) / records, 1)
                                             for c, t in med.items() if c != "plain"},
                           "step_over_plain": {c: round(t / med["plain"], 3) for c, t in med.items()},
                           "cpu_ms": {c: round(1e3 * t, 3) for c, t in cpu.items()},
                           "cpu_us_per_record": {c: round(1e6 * (t - cpu["plain"]) / records, 1)
                                                 for c, t in cpu.items() if c != "plain"}}
    print(f"{name:7s} {records:4d} records ({stats.compressed} quantized): "
          + ", ".join(f"{c} {1e3 * t:7.2f} ms" for c, t in med.items()) + " | per record above plain: "
          + ", ".join(f"{c} {v:6.1f} us" for c, v in row["us_per_record"].items()) + " (CPU time: "
          + ", ".join(f"{c} {v:6.1f} us" for c, v in row["cpu_us_per_record"].items()) + ")", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = [run_model(m, args.steps, args.rounds) for m in args.models.split(",")]
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.out:
        write_json(args.out, {"steps": args.steps, "rounds": args.rounds, "load_average_before": list(load_before),
                              "rows": rows})


if __name__ == "__main__":
    main()
