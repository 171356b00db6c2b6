"""No context leaks: a new ``compress`` per step (the inline pattern) and one reused context both keep
memory flat, with or without the cyclic garbage collector."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import daftrain

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"


@pytest.mark.parametrize("kwargs", [{"bits": 2}, {"bits": None}, {"bits": 2, "asynchronous": True},
                                    {"bits": "auto"}])
def test_a_context_per_step_is_freed_without_the_cyclic_collector(kwargs):
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    refs = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            ctx = daftrain.compress(model=model, **kwargs)
            refs.append(weakref.ref(ctx))
            with ctx:
                loss = model(torch.randn(64, 128)).sum()
            loss.backward()
            ctx.close()
            del ctx, loss
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of 5 contexts still alive after their graphs were freed"


_FIRST_CONTEXT = """
import gc, sys, weakref
import torch
from torch import nn
import daftrain
gc.disable()  # from the start: the first forward of the process runs without the cyclic collector
model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
refs = []
for _ in range(3):
    ctx = daftrain.compress(bits=int(sys.argv[1]), model=model)
    refs.append(weakref.ref(ctx))
    with ctx:
        loss = model(torch.randn(64, 128)).sum()
    loss.backward()
    del ctx, loss
print([r() is not None for r in refs])
"""


@pytest.mark.parametrize("bits", [2, 8])
def test_the_first_context_of_a_process_is_freed_without_the_cyclic_collector(bits):
    """NOTE [ No Dynamo guard on the kernels ] in kernels/registry.py: a one-time import during the first
    pack once left a self-referring frame whose ``f_back`` chain held the first context."""
    out = subprocess.run([sys.executable, "-c", _FIRST_CONTEXT, str(bits)], check=True, capture_output=True,
                         text=True, timeout=300).stdout
    assert out.strip().splitlines()[-1] == "[False, False, False]", out


def test_the_context_stays_alive_while_its_graph_needs_it():
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.randn(64, 128)
    with daftrain.compress(bits=8, model=model):
        loss = model(x).sum()
    gc.collect()  # nothing but the graph refers to the context now
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
def test_soak_1000_steps_flat_rss_in_both_patterns(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--steps", "1000", "--out", str(out)], check=True,
                          capture_output=True, text=True, timeout=1800)
    import json

    results = json.loads(out.read_text())["results"]
    assert {r["pattern"] for r in results} == {"inline", "reused"}, proc.stdout
    for r in results:
        assert r["slope_mb_per_1000_steps"] < 1.0, proc.stdout
