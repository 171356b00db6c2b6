"""Every script in examples/ runs, in its own process, on a few steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_plain_loop():
    out = _run("plain_loop.py", "--steps", "3", "--batch-size", "16")
    assert "quantized" in out and "loss" in out


def test_hf_trainer():
    out = _run("hf_trainer.py", "--steps", "2", "--gradient-checkpointing")
    assert "quantized" in out
    recomputed = out.split("last recomputed layer:")[1]
    assert int(recomputed.split(" quantized")[0].split(",")[-1]) > 0, out  # the recomputation was compressed


def test_lightning_fit():
    out = _run("lightning_fit.py", "--steps", "2", "--batch-size", "16")
    assert "quantized" in out


def test_compile():
    out = _run("compile.py", "--steps", "3", "--batch-size", "16", "--backend", "aot_eager")
    assert "loss" in out
    quantized = int(out.split("compiled graphs:")[1].split(";")[1].split()[0])
    assert quantized > 0, out
