"""FSDP2 (``fully_shard``) on CPU with gloo: two real processes (``torch.distributed.run``) train with
``compress``; exact mode equals one process on the whole batch, and 2-bit mode quantizes the
activations but never the all-gathered (unsharded) weights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "fsdp.py"
TIMEOUT_S = 120  # a run takes a few seconds; a hang in a collective would otherwise wait for gloo's timeout
_STATS = re.compile(r"rank (\d): saved tensors (\d+): (\d+) quantized, (\d+) parameters, (\d+) kept exact")


def _run(tmp_path: Path, *args: str, distributed: bool = True) -> tuple[torch.Tensor, str]:
    out = tmp_path / f"params_{distributed}_{'_'.join(args)}.pt"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
                if distributed else [sys.executable])
    proc = subprocess.Popen([*launcher, str(SCRIPT), *args, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the run hung for {TIMEOUT_S} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return torch.load(out), stdout


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fsdp_exact_matches_one_process(tmp_path):
    sharded, stdout = _run(tmp_path, "--bits", "none")
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    single, _ = _run(tmp_path, "--bits", "none", distributed=False)
    assert _rel(sharded, single) < 1e-5  # exact: only the reduce-scatter's summation order differs


def test_fsdp_compressed_quantizes_activations_not_gathered_weights(tmp_path):
    sharded, stdout = _run(tmp_path, "--bits", "2")
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    single, single_out = _run(tmp_path, "--bits", "2", distributed=False)
    stats = {int(m[0]): tuple(map(int, m[1:])) for m in _STATS.findall(stdout)}
    (_, seen, quantized, parameters, _), = (tuple(map(int, m)) for m in _STATS.findall(single_out))
    assert set(stats) == {0, 1}, stdout
    for _, (seen_r, quantized_r, parameters_r, _) in stats.items():
        # The same saves as one process: the activations quantized, the two weights that linear saves
        # (the all-gathered, unsharded parameters under FSDP) recognised as parameters and kept.
        assert (seen_r, quantized_r, parameters_r) == (seen, quantized, parameters) and quantized > 0 \
            and parameters == 2, stdout
    # Each process rounds its own activations with its own draws (2-bit, stochastic rounding): the
    # gradients are noisy, unbiased estimates, and after 3 SGD steps the parameters stay within 2 %.
    assert _rel(sharded, single) < 2e-2


@pytest.mark.parametrize("wrap", ["layers", "root"])
def test_fsdp_wide_head_keeps_the_loss_through_the_layer(tmp_path, wrap):
    # A head wider than its input, as a language model's, whose loss the model computes. FSDP gathers a resharded
    # weight and queues the gradients' reduction from hooks on outputs that a cross-entropy run over the layer
    # would bypass: in a process group the loss goes through the layer (saved/linear_cross_entropy.py), and
    # one process alone runs it over the layer. Both train alike.
    args = ("--bits", "2", "--classes", "2048", "--wrap", wrap)
    sharded, stdout = _run(tmp_path, *args)
    assert stdout.count("loss node _SavingLogitsBackward") == 2, stdout
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    single, single_out = _run(tmp_path, *args, distributed=False)
    assert "loss node _OverLinearBackward" in single_out, single_out
    assert _rel(sharded, single) < 2e-2
