"""Process peak memory a user sees: plain PyTorch against daftrain, per phase.

Each (model, configuration) runs in a fresh process with default allocator settings (unless the
configuration is an allocator setting). Once the model, optimizer and batch exist, the RSS is the
baseline; then ``--steps`` training steps run and each phase's peak RSS above that baseline is read from
the kernel's high-water mark (``/proc/self/status`` VmHWM, reset with ``/proc/self/clear_refs`` at each
phase start): forward, backward, optimizer step. The step's peak is the largest. Step time is the median
of the steps after the first two. Configurations are interleaved, ``--repeats`` rounds.

    .venv/bin/python benchmarks/bench_peak_memory.py --models resnet18,gpt2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "plain": {},
    "bits2": {"bits": 2},
    "bits4": {"bits": 4},
    "bits2+ckpt": {"bits": 2, "checkpoint": True},
    "plain+ckpt": {"checkpoint": True},
}


def build(model_name: str):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model_name == "resnet18":
        from daftrain.demo.models import resnet18

        model = resnet18(num_classes=10, width=64)
        batch = (torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,)))

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return nn.functional.cross_entropy(m(b[0]), b[1])
    elif model_name == "gpt2":
        from daftrain.demo.models.transformers_zoo import gpt2_lm

        model = gpt2_lm(n_positions=256)
        ids = torch.randint(0, 50257, (8, 256))
        batch = (ids,)

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return m(input_ids=b[0], labels=b[0]).loss
    elif model_name == "minilm_lora":
        from daftrain.demo.models.transformers_zoo import bert_classifier, with_lora

        model = with_lora(bert_classifier(num_labels=3, num_hidden_layers=6, hidden_size=384,
                                          num_attention_heads=12, intermediate_size=1536), r=8)
        ids = torch.randint(0, 30522, (32, 128))
        batch = (ids, torch.randint(0, 3, (32,)))

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return m(input_ids=b[0], labels=b[1]).loss
    else:
        raise SystemExit(f"unknown model {model_name}")
    model.train()
    return model, batch, loss_fn


def worker(model_name: str, config_name: str, steps: int) -> dict:
    import contextlib

    import torch

    import daftrain
    from daftrain.budget.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from daftrain.budget.segments import checkpointing, find_segments

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = CONFIGS[config_name]
    model, batch, loss_fn = build(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ctx = daftrain.compress(bits=cfg["bits"], model=model) if "bits" in cfg else contextlib.nullcontext()
    segments = find_segments(model) if cfg.get("checkpoint") else {}
    reset_peak_rss()
    baseline = current_rss_bytes()
    phases: list[dict[str, int]] = []
    times: list[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        reset_peak_rss()
        with checkpointing(segments, list(segments)) if segments else contextlib.nullcontext(), ctx:
            loss = loss_fn(model, batch)
        fwd = peak_rss_bytes() - baseline
        reset_peak_rss()
        loss.backward()
        del loss
        bwd = peak_rss_bytes() - baseline
        reset_peak_rss()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        opt = peak_rss_bytes() - baseline
        times.append(time.perf_counter() - start)
        phases.append({"forward": fwd, "backward": bwd, "optimizer": opt})
    peak = max(max(p.values()) for p in phases)
    out = {"model": model_name, "config": config_name, "baseline_mb": baseline / 1e6, "peak_mb": peak / 1e6,
           "phases_mb": {k: max(p[k] for p in phases) / 1e6 for k in phases[0]},
           "first_step_s": times[0], "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
           "end_rss_mb": (current_rss_bytes() - baseline) / 1e6}
    if hasattr(ctx, "stats"):
        s = ctx.stats
        out["saved_mb"] = {"raw": s.raw_bytes / 1e6, "stored": (s.packed_bytes + s.kept_bytes) / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,gpt2,minilm_lora")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "peak_memory.json"))
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import write_json

    rows = []
    for _ in range(args.repeats):
        for model in args.models.split(","):
            for config in args.configs.split(","):  # interleaved: every configuration once per round
                cmd = [sys.executable, __file__, "--worker", model, config, "--steps", str(args.steps)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-3000:])
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"{model:>12} {config:>11}: peak {r['peak_mb']:8.1f} MB above baseline "
                      f"(fwd {r['phases_mb']['forward']:.0f}, bwd {r['phases_mb']['backward']:.0f}, "
                      f"opt {r['phases_mb']['optimizer']:.0f}); step {r['step_s']:.3f} s, "
                      f"first {r['first_step_s']:.2f} s",
                      flush=True)
    summary = {}
    for model in args.models.split(","):
        def med(config: str, key: str, m: str = model) -> float:
            return statistics.median(r[key] for r in rows if r["model"] == m and r["config"] == config)
        plain_peak, plain_time = med("plain", "peak_mb"), med("plain", "step_s")
        summary[model] = {c: {"peak_reduction_x": plain_peak / med(c, "peak_mb"),
                              "time_ratio": med(c, "step_s") / plain_time,
                              "first_over_steady": med(c, "first_step_s") / med(c, "step_s")}
                          for c in args.configs.split(",")}
        for c, v in summary[model].items():
            print(f"{model:>12} {c:>11}: {v['peak_reduction_x']:.2f}x less peak than plain, "
                  f"{v['time_ratio']:.2f}x plain's step time, first step {v['first_over_steady']:.1f}x steady")
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
