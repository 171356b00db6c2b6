"""Process peak memory a user sees: plain PyTorch against daftrain, per phase, and the step time.

Each (model, configuration) runs in a fresh process with default allocator settings (unless the
configuration is an allocator setting). Once the model, optimizer and batch exist, the RSS is the
baseline; then ``--steps`` training steps run and each phase's peak RSS above that baseline is read from
the kernel's high-water mark (``/proc/self/status`` VmHWM, reset with ``/proc/self/clear_refs`` at each
phase start): forward, backward, optimizer step. The step's peak is the largest. Step time (wall and
process CPU) and minor page faults per step are medians over the steps after the first two.
Configurations are interleaved, ``--repeats`` rounds.

The allocator configurations (``ALLOCATOR_CONFIGS``) compare glibc settings: ``+mmap64k``,
``+mmap1m``, ``+mmap4m`` fix the mmap threshold (``mallopt(M_MMAP_THRESHOLD)``); ``+trim`` keeps glibc's
defaults and calls ``malloc_trim(0)`` when each forward ends and each step starts, ``+trim16m``,
``+trim64m``, ``+trim256m`` also whenever that many more bytes went through the pack and unpack hooks;
``+hugetlb`` starts the process with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc advises transparent
huge pages for what it maps), ``+thp`` with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch does, for its tensors of
2 MiB and more); ``+untuned`` is ``compress(tune_allocator=False)``. ``bits2+rows`` is
``compress(bits=2, column_groups=False)``: groups in memory order only (by default they run down a tensor's
columns where that pays; result files before that default name the opt-in ``+columns``); ``+uniform`` is
``compress(fitted_grids=False)``: evenly spaced levels everywhere (``NOTE [ Fitted grids ]``); ``bits2+logits`` is
``compress(bits=2, linear_cross_entropy=False)``: a language model's loss saves its logits instead of running
over its head (``NOTE [ Cross-entropy over a wide linear layer ]``). Models: ``resnet18`` (CIFAR-style, batch 128),
``gpt2`` (GPT-2 small, 8 x 256 tokens), ``minilm_lora`` (MiniLM + LoRA, 32 x 128; eager attention, as the
project's builders default to; ``minilm_lora_sdpa`` with ``F.scaled_dot_product_attention``, Hugging Face's
default), ``llama_lora`` (a Llama-style
decoder, 4 layers of 512, a 32000-token vocabulary, 4 x 512 tokens, LoRA on q and v, its head frozen),
``bert_long_sdpa`` (a BERT encoder, 4 layers of 384 with 12 heads, SDPA with dropout, 2 x 1024 tokens: long
sequences in a small batch).
``compile`` runs the model under ``torch.compile`` (inductor), ``compile+bits2`` / ``+bits4`` under
``compress`` too (the packing inlined into the compiled graphs): their first step compiles, so next to
the peak over every step each row has ``steady_peak_mb``, the peak over the steps after the first two
(those step times are medians over, too; a Hugging Face model sets its ``config.problem_type`` in its
first forward, on which Dynamo guards, so its second step compiles again). ``compile+bits2+decodes_first``
leaves out the pass that decodes each saved tensor at its first use in the compiled backward
(``NOTE [ Decodes at their first use ]``): every record is decoded where AOTAutograd inlines the unpack
hooks, before the first gradient.

``--device cuda`` runs on the GPU: the baseline is ``torch.cuda.memory_allocated`` once model, optimizer
and batch are on the device, each phase's peak is ``torch.cuda.max_memory_allocated`` above it (reset
with ``reset_peak_memory_stats`` at each phase start, never ``empty_cache``: default caching-allocator
settings), and ``max_memory_reserved`` above the reserved baseline is reported beside it
(``peak_reserved_mb``); every timed step ends with ``torch.cuda.synchronize()``. The allocator
configurations are glibc's and run on CPU only.

``--micro-batch N`` runs each step as a hand-written accumulation loop over micro-batches of ``N``
samples (what ``BudgetedStep`` runs at tight budgets), the phase peaks read without trimming between
micro-batches: the forward phase is the largest forward, the backward phase the largest backward.

    .venv/bin/python benchmarks/bench_peak_memory.py --models resnet18,gpt2 --repeats 1
    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_peak_memory.py --models resnet18 \
        --configs plain,plain+mmap64k,plain+hugetlb,bits2+untuned,bits2,bits2+hugetlb --steps 7 --repeats 3 \
        --out benchmarks/results/allocator_step_time.json
    python benchmarks/bench_peak_memory.py --device cuda --configs plain,bits4,bits2,bits2+ckpt,plain+ckpt \
        --steps 8 --repeats 3 --out benchmarks/results/peak_memory_cuda.json
    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_peak_memory.py --models resnet18 \
        --configs plain,plain+mmap64k,plain+mmap1m --micro-batch 2 --steps 5 --repeats 3 \
        --out benchmarks/results/allocator_micro_batches.json
    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_peak_memory.py --models resnet18,minilm_lora \
        --configs plain,compile,compile+bits2,compile+bits2+decodes_first,bits2 --steps 7 --repeats 3 \
        --out benchmarks/results/peak_memory_compile.json
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
    "bits2+rows": {"bits": 2, "compress": {"column_groups": False}},
    "bits4+rows": {"bits": 4, "compress": {"column_groups": False}},
    "bits2+uniform": {"bits": 2, "compress": {"fitted_grids": False}},
    "bits2+logits": {"bits": 2, "compress": {"linear_cross_entropy": False}},
    "bits4+uniform": {"bits": 4, "compress": {"fitted_grids": False}},
    "compile": {"compile": True},
    "compile+bits2": {"bits": 2, "compile": True},
    "compile+bits4": {"bits": 4, "compile": True},
    "compile+bits2+decodes_first": {"bits": 2, "compile": True, "decodes_first": True},
}
_HUGETLB = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
_TORCH_THP = {"THP_MEM_ALLOC_ENABLE": "1"}
ALLOCATOR_CONFIGS = {
    "plain+mmap64k": {"mmap_threshold": 1 << 16},
    "plain+mmap1m": {"mmap_threshold": 1 << 20},
    "plain+trim": {"trim": True},
    "plain+hugetlb": {"env": _HUGETLB},
    "bits2+untuned": {"bits": 2, "tune": False},
    "bits2+mmap64k": {"bits": 2, "tune": False, "mmap_threshold": 1 << 16},
    "bits2+mmap1m": {"bits": 2, "tune": False, "mmap_threshold": 1 << 20},
    "bits2+mmap4m": {"bits": 2, "tune": False, "mmap_threshold": 4 << 20},
    "bits2+trim": {"bits": 2, "tune": False, "trim": True},
    "bits2+mmap64k+trim": {"bits": 2, "tune": False, "mmap_threshold": 1 << 16, "trim": True},
    "bits2+trim16m": {"bits": 2, "tune": False, "trim": True, "trim_every": 16 << 20},
    "bits2+trim64m": {"bits": 2, "tune": False, "trim": True, "trim_every": 64 << 20},
    "bits2+trim256m": {"bits": 2, "tune": False, "trim": True, "trim_every": 256 << 20},
    "bits2+mmap32m+trim64m": {"bits": 2, "tune": False, "mmap_threshold": 32 << 20, "trim": True,
                              "trim_every": 64 << 20},
    "bits2+hugetlb": {"bits": 2, "env": _HUGETLB},
    "bits2+untuned+hugetlb": {"bits": 2, "tune": False, "env": _HUGETLB},
    "plain+thp": {"env": _TORCH_THP},
    "bits2+ckpt+mmap64k": {"bits": 2, "checkpoint": True, "tune": False, "mmap_threshold": 1 << 16},
    "plain+ckpt+mmap64k": {"checkpoint": True, "mmap_threshold": 1 << 16},
    "bits2+thp": {"bits": 2, "env": _TORCH_THP},
}
CONFIGS.update(ALLOCATOR_CONFIGS)


def build(model_name: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model_name in ("resnet18", "resnet18_channels_last"):
        from daftrain.demo.models import resnet18

        model = resnet18(num_classes=10, width=64)
        batch = (torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,)))
        if model_name == "resnet18_channels_last":  # the memory format CNNs are often trained in
            model = model.to(memory_format=torch.channels_last)
            batch = (batch[0].contiguous(memory_format=torch.channels_last), batch[1])

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return nn.functional.cross_entropy(m(b[0]), b[1])
    elif model_name == "gpt2":
        from daftrain.demo.models.transformers_zoo import gpt2_lm

        model = gpt2_lm(n_positions=256)
        ids = torch.randint(0, 50257, (8, 256))
        batch = (ids,)

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return m(input_ids=b[0], labels=b[0]).loss
    elif model_name in ("minilm_lora", "minilm_lora_sdpa"):
        from daftrain.demo.models.transformers_zoo import bert_classifier, with_lora

        attention = "sdpa" if model_name.endswith("_sdpa") else "eager"
        model = with_lora(bert_classifier(num_labels=3, num_hidden_layers=6, hidden_size=384, num_attention_heads=12,
                                          intermediate_size=1536, attn_implementation=attention), r=8)
        ids = torch.randint(0, 30522, (32, 128))
        batch = (ids, torch.randint(0, 3, (32,)))

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return m(input_ids=b[0], labels=b[1]).loss
    elif model_name == "bert_long_sdpa":  # long sequences in a small batch: SDPA's math path, a sample too big a chunk
        import transformers

        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=384, num_hidden_layers=4, num_attention_heads=12, intermediate_size=1536,
            max_position_embeddings=1024, attn_implementation="sdpa"))
        ids = torch.randint(0, 30522, (2, 1024))
        batch = (ids, torch.randint(0, 2, (2,)))

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return m(input_ids=b[0], labels=b[1]).loss
    elif model_name == "llama_lora":  # a Llama-style decoder fine-tuned with LoRA, its 32000-token head frozen
        import transformers
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, max_position_embeddings=512, use_cache=False)),
            LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        ids = torch.randint(0, 32000, (4, 512))
        batch = (ids,)

        def loss_fn(m, b):  # type: ignore[no-untyped-def]
            return m(input_ids=b[0], labels=b[0]).loss
    else:
        raise SystemExit(f"unknown model {model_name}")
    model.train()
    return model.to(device), tuple(t.to(device) for t in batch), loss_fn


class PhasePeaks:
    """Each phase's peak above the baseline taken at construction: the RSS's high-water mark on CPU;
    on CUDA the caching allocator's peak allocated bytes, and its peak reserved bytes beside them."""

    def __init__(self, device: str) -> None:
        import torch

        from daftrain.rss import current_rss_bytes, reset_peak_rss

        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            self.baseline_reserved = torch.cuda.memory_reserved()
        else:
            reset_peak_rss()
            self.baseline = current_rss_bytes()
            self.baseline_reserved = 0
        self.reserved_peak = 0

    def reset(self, *, trim: bool = True) -> None:
        """Begin a phase (``trim``: glibc's ``malloc_trim`` first, on CPU; the CUDA cache is never emptied)."""
        import torch

        from daftrain.rss import reset_peak_rss

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss(trim=trim)

    def peak(self) -> int:
        """The phase's peak so far, above the baseline."""
        import torch

        from daftrain.rss import peak_rss_bytes

        if not self.cuda:
            return peak_rss_bytes() - self.baseline
        torch.cuda.synchronize()
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved() - self.baseline_reserved)
        return torch.cuda.max_memory_allocated() - self.baseline

    def current(self) -> int:
        """Held now, above the baseline."""
        import torch

        from daftrain.rss import current_rss_bytes

        return (torch.cuda.memory_allocated() if self.cuda else current_rss_bytes()) - self.baseline


def instrument() -> dict[str, float]:
    """Wrap daftrain's pack and unpack hooks, and the op-aware encoding of normalisation inputs inside them,
    with timers; returns the dict of seconds (and, ``*_faults``, minor page faults) they add to (cumulative,
    nested: ``pack`` includes ``pack_normalized``)."""
    import resource
    from collections import defaultdict

    from daftrain.saved import hooks, records

    acc: dict[str, float] = defaultdict(float)

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            start, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - start
                acc[f"{label}_faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

        setattr(owner, name, wrapper)

    timed(hooks.compress, "_pack", "pack")
    timed(hooks.compress, "_unpack", "unpack")
    timed(records.Normalized, "candidate", "pack_normalized")
    timed(records.NormalizedRecord, "decode", "unpack_normalized")
    return acc


def trim_in_hooks(trim, every: int) -> None:  # type: ignore[no-untyped-def]
    """Call ``trim(0)`` from the pack and unpack hooks whenever ``every`` more bytes went through them."""
    from daftrain.saved import hooks

    seen = [0]

    def counted(fn, nbytes):  # type: ignore[no-untyped-def]
        def wrapper(self, arg):  # type: ignore[no-untyped-def]
            out = fn(self, arg)
            seen[0] += nbytes(arg, out)
            if seen[0] >= every:
                seen[0] = 0
                trim(0)
            return out

        return wrapper

    hooks.compress._pack = counted(hooks.compress._pack, lambda t, _: t.numel() * t.element_size())
    hooks.compress._unpack = counted(hooks.compress._unpack, lambda _, t: t.numel() * t.element_size())


def largest_saved_bytes(model, batch, loss_fn) -> int:  # type: ignore[no-untyped-def]
    """The bytes of the largest tensor one forward saves for backward (plain PyTorch)."""
    import torch

    largest = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        largest[0] = max(largest[0], t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model, batch)
    del loss
    return largest[0]


def accumulate(model, batch, loss_fn, micro: int, ctx, meter: PhasePeaks) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Forward and backward of ``batch`` in micro-batches of ``micro`` samples (losses weighted by their
    share); return the largest forward and the largest backward peak above ``meter``'s baseline."""
    from daftrain.budget.batching import balanced_sizes, batch_size, split_batch

    total = batch_size(batch)
    fwd = bwd = 0
    for part in split_batch(batch, balanced_sizes(total, -(-total // micro))):
        with ctx:
            loss = loss_fn(model, part) * (batch_size(part) / total)
        fwd = max(fwd, meter.peak())
        meter.reset(trim=False)
        loss.backward()
        del loss
        bwd = max(bwd, meter.peak())
        meter.reset(trim=False)
    return fwd, bwd


def worker(model_name: str, config_name: str, steps: int, breakdown: bool = False, micro: int = 0,
           device: str = "cpu") -> dict:
    import contextlib
    import ctypes
    import resource

    import torch

    import daftrain
    from daftrain.allocator import glibc
    from daftrain.budget.segments import checkpointing, find_segments

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = CONFIGS[config_name]
    if device != "cpu" and config_name in ALLOCATOR_CONFIGS:
        raise SystemExit(f"{config_name} sets glibc's allocator: it runs with --device cpu only")
    if "mmap_threshold" in cfg:
        glibc().mallopt(-3, cfg["mmap_threshold"])  # M_MMAP_THRESHOLD
    trim = glibc().malloc_trim if cfg.get("trim") else None
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
    if cfg.get("trim_every"):
        trim_in_hooks(trim, cfg["trim_every"])
    model, batch, loss_fn = build(model_name, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ctx = (daftrain.compress(bits=cfg["bits"], model=model, tune_allocator=cfg.get("tune", True),
                             **cfg.get("compress", {}))
           if "bits" in cfg else contextlib.nullcontext())
    segments = find_segments(model) if cfg.get("checkpoint") else {}
    if cfg.get("compile") and (segments or micro):
        raise SystemExit(f"{config_name}: compiled configurations run whole batches without checkpointing")
    forward = torch.compile(model) if cfg.get("compile") else model
    if cfg.get("decodes_first"):  # the backward decodes where AOTAutograd inlines them: the pass not installed
        import daftrain.saved.compiled

        daftrain.saved.compiled.install_decode_order = lambda: None
    if micro and segments:
        raise SystemExit(f"{config_name}: --micro-batch runs without checkpointing; pick a configuration without it")
    hook_times = instrument() if breakdown and "bits" in cfg else None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    per_step_hooks: list[dict[str, float]] = []
    meter = PhasePeaks(device)
    phases: list[dict[str, int]] = []
    times: list[float] = []
    cpu_times: list[float] = []
    sys_times: list[float] = []
    faults: list[int] = []
    for _ in range(steps):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        if hook_times is not None:
            hook_times.clear()
        if trim is not None:
            trim(0)
        meter.reset()
        if micro:
            fwd, bwd = accumulate(model, batch, loss_fn, micro, ctx, meter)
        else:
            recompute = ctx if "bits" in cfg else None  # the recomputation stored compressed too
            with checkpointing(segments, list(segments), recompute) if segments else contextlib.nullcontext(), ctx:
                loss = loss_fn(forward, batch)
            if trim is not None:
                trim(0)
            fwd = meter.peak()
            meter.reset()
            loss.backward()
            del loss
            bwd = meter.peak()
        meter.reset()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        opt = meter.peak()
        sync()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        end_usage = resource.getrusage(resource.RUSAGE_SELF)
        sys_times.append(end_usage.ru_stime - usage.ru_stime)  # kernel time: page faults, unmapping
        if hook_times is not None:
            per_step_hooks.append(dict(hook_times))
        faults.append(end_usage.ru_minflt - usage.ru_minflt)
        phases.append({"forward": fwd, "backward": bwd, "optimizer": opt})
    peak = max(max(p.values()) for p in phases)
    out = {"model": model_name, "config": config_name, "micro_batch": micro or None, "device": device,
           "baseline_mb": meter.baseline / 1e6, "peak_mb": peak / 1e6,
           "steady_peak_mb": max(max(p.values()) for p in phases[2:]) / 1e6 if len(phases) > 2 else peak / 1e6,
           "phases_mb": {k: max(p[k] for p in phases) / 1e6 for k in phases[0]},
           "steady_phases_mb": {k: max(p[k] for p in phases[2:] or phases) / 1e6 for k in phases[0]},
           "first_step_s": times[0], "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
           "step_cpu_s": statistics.median(cpu_times[2:]) if len(times) > 2 else cpu_times[-1],
           "step_sys_s": statistics.median(sys_times[2:]) if len(times) > 2 else sys_times[-1],
           "minor_faults": statistics.median(faults[2:]) if len(times) > 2 else faults[-1],
           "steps_s": times, "end_rss_mb": meter.current() / 1e6,
           "load_average": list(os.getloadavg())}
    if device == "cuda":
        out["peak_reserved_mb"] = meter.reserved_peak / 1e6
        out["gpu"] = torch.cuda.get_device_name()
        out["torch"] = torch.__version__
    if per_step_hooks:
        later = per_step_hooks[2:] or per_step_hooks
        out["hooks_s"] = {k: statistics.median(h.get(k, 0.0) for h in later) for k in per_step_hooks[-1]}
    if "bits" not in cfg and not cfg.get("checkpoint"):
        out["largest_saved_mb"] = largest_saved_bytes(model, batch, loss_fn) / 1e6
    # What no activation scheme removes: the gradients of the trainable parameters and the optimizer's
    # state, both created by the first step and resident (above the baseline) at the optimizer step.
    out["floor_mb"] = (sum(p.numel() * p.element_size() for p in params)
                       + sum(t.numel() * t.element_size() for st in optimizer.state.values()
                             for t in st.values() if torch.is_tensor(t))) / 1e6
    if hasattr(ctx, "stats"):
        s = ctx.stats
        out["saved_mb"] = {"raw": s.raw_bytes / 1e6, "stored": (s.packed_bytes + s.kept_bytes) / 1e6}
        if s.compiled_graphs:  # per call of every compiled graph
            out["compiled_saved_mb"] = {"raw": s.compiled_raw_bytes / 1e6, "stored": s.compiled_stored_bytes / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,gpt2,minilm_lora")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "peak_memory.json"))
    ap.add_argument("--breakdown", action="store_true",
                    help="time daftrain's pack and unpack hooks inside each step (adds a little overhead)")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="run each step as accumulation over micro-batches of this many samples")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: peaks from the caching allocator (allocated, and reserved beside it)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps, args.breakdown, args.micro_batch,
                                args.device)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import write_json

    rows = []
    for _ in range(args.repeats):
        for model in args.models.split(","):
            for config in args.configs.split(","):  # interleaved: every configuration once per round
                cmd = [sys.executable, __file__, "--worker", model, config, "--steps", str(args.steps)]
                cmd += ["--breakdown"] if args.breakdown else []
                cmd += ["--micro-batch", str(args.micro_batch)] if args.micro_batch else []
                cmd += ["--device", args.device]
                env = {**os.environ, **CONFIGS[config].get("env", {})}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-3000:])
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                reserved = f" (reserved {r['peak_reserved_mb']:.0f})" if "peak_reserved_mb" in r else ""
                print(f"{model:>12} {config:>11}: peak {r['peak_mb']:8.1f} MB{reserved} above baseline "
                      f"(fwd {r['phases_mb']['forward']:.0f}, bwd {r['phases_mb']['backward']:.0f}, "
                      f"opt {r['phases_mb']['optimizer']:.0f}); step {r['step_s']:.3f} s "
                      f"(cpu {r['step_cpu_s']:.2f} s, sys {r['step_sys_s']:.2f} s, {r['minor_faults']:.0f} faults), "
                      f"first {r['first_step_s']:.2f} s; load {r['load_average'][0]:.2f}",
                      flush=True)
                if "hooks_s" in r:
                    print(" " * 26 + ", ".join(f"{k} {v:.0f}" if k.endswith("_faults") else f"{k} {v:.3f} s"
                                               for k, v in r["hooks_s"].items()), flush=True)
    summary = {}
    for model in args.models.split(","):
        def med(config: str, key: str, m: str = model) -> float:
            return statistics.median(r[key] for r in rows if r["model"] == m and r["config"] == config)

        if not any(r["model"] == model and r["config"] == "plain" for r in rows):
            print(f"{model:>12} no ratios: plain PyTorch was not among the configurations run")
            continue
        plain_peak, plain_time = med("plain", "peak_mb"), med("plain", "step_s")
        plain_cpu = med("plain", "step_cpu_s")
        plain_steady = med("plain", "steady_peak_mb")
        summary[model] = {c: {"peak_mb": med(c, "peak_mb"), "peak_reduction_x": plain_peak / med(c, "peak_mb"),
                              "steady_peak_mb": med(c, "steady_peak_mb"),
                              "steady_reduction_x": plain_steady / med(c, "steady_peak_mb"),
                              **({"peak_reserved_mb": med(c, "peak_reserved_mb"),
                                  "reserved_reduction_x":
                                      med("plain", "peak_reserved_mb") / med(c, "peak_reserved_mb")}
                                 if args.device == "cuda" else {}),
                              "step_s": med(c, "step_s"), "time_ratio": med(c, "step_s") / plain_time,
                              "cpu_time_ratio": med(c, "step_cpu_s") / plain_cpu,
                              "step_cpu_s": med(c, "step_cpu_s"), "step_sys_s": med(c, "step_sys_s"),
                              "minor_faults": med(c, "minor_faults"),
                              "first_over_steady": med(c, "first_step_s") / med(c, "step_s")}
                          for c in args.configs.split(",")}
        floor = med("plain", "floor_mb")
        print(f"{model:>12} floor (gradients + optimizer state) {floor:.0f} MB: no activation scheme gets under it, "
              f"so at most {plain_peak / floor:.1f}x less than plain; 4x needs <= {plain_peak / 4:.0f} MB, "
              f"10x <= {plain_peak / 10:.0f} MB")
        summary[model]["floor_mb"] = floor
        optimizer = statistics.median(r["phases_mb"]["optimizer"] for r in rows
                                      if r["model"] == model and r["config"] == "plain")
        print(f"{model:>12} plain's optimizer step {optimizer:.0f} MB (the floor and the optimizer's temporaries): no "
              f"activation scheme changes it, so at most {plain_peak / optimizer:.1f}x less than plain")
        summary[model]["optimizer_phase_mb"] = optimizer
        largest = med("plain", "largest_saved_mb")
        bound = floor + largest
        print(f"{model:>12} largest saved tensor {largest:.0f} MB: backward decodes it whole, so a scheme that "
              f"runs PyTorch's backward ops on decoded tensors peaks at >= {bound:.0f} MB "
              f"(at most {plain_peak / bound:.1f}x less than plain) unless an op rule saves less")
        summary[model]["largest_saved_mb"] = largest
        summary[model]["decode_bound_mb"] = bound
        for c, v in summary[model].items():
            if c in ("floor_mb", "optimizer_phase_mb", "largest_saved_mb", "decode_bound_mb"):
                continue
            reserved = (f" ({v['reserved_reduction_x']:.2f}x less reserved)" if "reserved_reduction_x" in v else "")
            print(f"{model:>12} {c:>11}: {v['peak_reduction_x']:.2f}x less peak than plain{reserved} "
                  f"({v['steady_reduction_x']:.2f}x after the first step), "
                  f"{v['time_ratio']:.2f}x plain's step time ({v['cpu_time_ratio']:.2f}x its CPU time), "
                  f"{v['minor_faults']:.0f} faults and {v['step_sys_s']:.2f} s in the kernel a step, "
                  f"first step {v['first_over_steady']:.1f}x steady")
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
