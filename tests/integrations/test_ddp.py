"""DistributedDataParallel: two real processes on gloo (``torch.distributed.run``) train with compressed
activations; every rank ends with the same parameters, equal to one process on the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ddp.py"


def _run(tmp_path: Path, *args: str, nproc: int | None = 2) -> tuple[torch.Tensor, str]:
    out = tmp_path / f"params_{nproc}_{'_'.join(args)}.pt"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                 "--standalone"] if nproc else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out), proc.stdout


@pytest.mark.parametrize("bits", ["none", "2"])
def test_ddp_ranks_agree_and_match_one_process(tmp_path, bits):
    ddp, stdout = _run(tmp_path, "--steps", "3", "--bits", bits)
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    single, _ = _run(tmp_path, "--steps", "3", "--bits", bits, nproc=None)
    rel = ((ddp - single).norm() / single.norm()).item()
    if bits == "none":
        assert rel < 1e-5, rel  # exact mode: only the all-reduce's summation order differs
    else:
        # Each process rounds its own activations with its own draws: close, not equal.
        assert rel < 1e-2, rel
