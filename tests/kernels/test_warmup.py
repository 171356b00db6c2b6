"""The CPU kernels load when ``compress`` is constructed, not inside the first training step
(``NOTE [ Kernels load before the first step ]`` in kernels/cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daftrain.kernels import cpu

_CHILD = """
import json, torch, warnings
warnings.simplefilter("error", RuntimeWarning)  # a kernel that cannot load warns: fail the child on it
# PRELUDE
from numba.core.registry import CPUDispatcher
import daftrain
from daftrain.kernels import cpu

def loaded():
    return sum(sum(d.stats.cache_hits.values()) + sum(d.stats.cache_misses.values())
               for d in vars(cpu).values() if isinstance(d, CPUDispatcher))

model = torch.nn.Sequential(torch.nn.Linear(256, 256, device="cpu"), torch.nn.ReLU(),
                            torch.nn.Linear(256, 1, device="cpu"))
before = loaded()
ctx = daftrain.compress(bits=2, model=model)
constructed = loaded()
with ctx:
    loss = model(torch.randn(64, 256, device="cpu")).sum()
loss.backward()
print(json.dumps({"before": before, "constructed": constructed, "after_step": loaded(),
                  "warmed": cpu.warmup.cache_info().currsize == 1, "quantized": ctx.stats.compressed}))
"""


def _run_child(prelude: str = "") -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(Path(cpu.__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", _CHILD.replace("# PRELUDE", prelude)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_compress_loads_the_kernels_so_the_first_step_loads_none() -> None:
    out = _run_child()
    assert out["quantized"] > 0, out  # the step did run the kernels
    assert out["before"] == 0 and out["constructed"] > 0 and out["warmed"], out
    assert out["after_step"] == out["constructed"], f"the first step loaded or compiled kernels: {out}"


@pytest.mark.parametrize("prelude", ['torch.set_default_device("meta")', "torch.set_default_dtype(torch.float64)"],
                         ids=["device", "dtype"])
def test_the_kernels_load_under_defaults_set_elsewhere(prelude: str) -> None:
    """A script that calls ``torch.set_default_device("cuda")`` (or any other device) and keeps some work on the
    CPU, or ``torch.set_default_dtype(torch.float64)`` (scientific models): daftrain's own host tensors (the
    warm-up's, the reduction's calibration, its scratch buffers) name their device and dtype, so the kernels still
    load, and the step quantizes on the CPU."""
    out = _run_child(prelude)
    assert out["quantized"] > 0 and out["warmed"], out
    assert out["after_step"] == out["constructed"], f"the first step loaded or compiled kernels: {out}"


def test_warmup_runs_once_per_process(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cpu.warmup()
    calls = []
    monkeypatch.setattr(cpu, "quantize_pack_with", lambda *a: calls.append(a))
    cpu.warmup()
    assert calls == []
