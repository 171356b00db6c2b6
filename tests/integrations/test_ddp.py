"""DistributedDataParallel: two real processes on gloo (``torch.distributed.run``) train with compressed
activations; every rank ends with the same parameters, equal to one process on the whole batch. With
``BudgetedStep`` the ranks agree on one plan, also when their budgets differ, and micro-batches
all-reduce the gradients once per step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ddp.py"
# A run takes a few seconds; a regression that makes ranks wait on each other in a collective would
# otherwise block until gloo's 30-minute timeout.
TIMEOUT_S = 120


def _run(tmp_path: Path, *args: str, nproc: int | None = 2) -> tuple[torch.Tensor, str]:
    out = tmp_path / f"params_{nproc}_{abs(hash(args))}.pt"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                 "--standalone"] if nproc else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Own session, so a hung run's worker processes are killed with the launcher.
    proc = subprocess.Popen([*launcher, str(SCRIPT), *args, "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the run hung for {TIMEOUT_S} s (ranks waiting on each other?):\n{stdout[-3000:]}"
                    f"{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return torch.load(out), stdout


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bits", ["none", "2"])
def test_ddp_ranks_agree_and_match_one_process(tmp_path, bits):
    ddp, stdout = _run(tmp_path, "--steps", "3", "--bits", bits)
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    single, _ = _run(tmp_path, "--steps", "3", "--bits", bits, nproc=None)
    if bits == "none":
        assert _rel(ddp, single) < 1e-5  # exact mode: only the all-reduce's summation order differs
    else:
        # Each process rounds its own activations with its own draws: close, not equal.
        assert _rel(ddp, single) < 1e-2


def test_ddp_with_error_share_calibrates_on_each_rank_and_ranks_agree(tmp_path):
    # The context calibrates on each rank's own loss (extra backwards through the DDP graph, with no
    # gradient accumulated): the step's own backward still all-reduces, so the ranks end identical.
    ddp, stdout = _run(tmp_path, "--steps", "4", "--error-share", "0.01")
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    assert stdout.count("calibrated True") == 2, stdout
    single, _ = _run(tmp_path, "--steps", "4", "--error-share", "0.01", nproc=None)
    assert _rel(ddp, single) < 1e-2  # as fixed bits: each process rounds with its own draws


_STEP = re.compile(r"rank (\d): step (\d+) own k=(\d+) bits=(\S+) ckpt=\d+ \| run k=(\d+) bits=(\S+) ckpt=(\S+) "
                   r"peak=(\d+) budget=(\d+)")


def test_budgeted_ddp_ranks_with_different_budgets_agree(tmp_path):
    """From step 1 rank 1's budget is 20 MB above what it holds, rank 0's 96 MB: alone they choose
    different micro-batch counts (the old code then all-reduced once per micro-batch on each rank, so
    the ranks waited on each other forever); now both run the leaner plan, each micro-batch but the
    last under ``no_sync``, and the result equals one process on the whole batch."""
    # A global batch of 128 (64 per rank) needs ~30 MB above what a rank holds in one micro-batch; the
    # leanest plan (one sample at a time, with the planner's safety margin) needs ~17 MB, so 20 MB leaves
    # rank 1 alone a few micro-batches.
    args = ("--steps", "3", "--bits", "none", "--image-size", "32", "--batch-size", "128", "--no-checkpoint",
            "--budgeted", "--budget", "+96MB,+96MB", "--budget-from", "1:+96MB,+20MB", "--count-allreduce")
    ddp, stdout = _run(tmp_path, *args)
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    steps: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, step, own_k, _, run_k, run_bits, run_ckpt, peak, budget in _STEP.findall(stdout):
        steps[int(rank), int(step)] = (int(own_k), int(run_k))
        assert run_bits == "None" and run_ckpt == "-", stdout  # exact and nothing checkpointed, as asked
        assert int(peak) <= int(budget), stdout  # every rank under its own budget at every step
    assert len(steps) == 6, stdout
    for step in range(3):
        assert steps[0, step][1] == steps[1, step][1], stdout  # one plan on both ranks
        # ... the leaner of the two the ranks would run alone
        assert steps[0, step][1] == max(steps[0, step][0], steps[1, step][0]), stdout
    # at the change, rank 1's 20 MB leave it alone more micro-batches than rank 0's 96 MB (later the
    # budget, read relative to what each rank holds, may let one micro-batch fit again)
    assert steps[0, 1][0] < steps[1, 1][0], stdout
    # no_sync: one gradient all-reduce per step (the model fits one DDP bucket), not one per micro-batch
    assert stdout.count("gradient all-reduces 3 in 3 steps") == 2, stdout
    single, _ = _run(tmp_path, "--steps", "3", "--bits", "none", "--image-size", "32", "--batch-size", "128",
                     nproc=None)
    # Exact mode: accumulation over micro-batches and the all-reduce change only the summation order.
    assert _rel(ddp, single) < 1e-5


def test_budgeted_ddp_clips_the_all_reduced_gradient(tmp_path):
    """``max_grad_norm``: each rank clips the gradient DDP all-reduced over both ranks' micro-batches, so the
    ranks stay identical and equal one process clipping the whole batch's gradient by hand."""
    common = ("--steps", "3", "--bits", "none", "--image-size", "32", "--batch-size", "128", "--max-grad-norm", "0.05")
    ddp, stdout = _run(tmp_path, *common, "--no-checkpoint", "--budgeted", "--budget", "+96MB,+96MB", "--budget-from",
                       "1:+20MB,+20MB")
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    assert any(int(k) > 1 for *_, k, _, _, _, _ in _STEP.findall(stdout)), stdout  # micro-batches ran
    single, _ = _run(tmp_path, *common, nproc=None)
    unclipped, _ = _run(tmp_path, "--steps", "3", "--bits", "none", "--image-size", "32", "--batch-size", "128",
                        nproc=None)
    assert _rel(ddp, single) < 1e-5 < _rel(unclipped, single)  # clipped as one process clips, and clipping acted


def test_budgeted_ddp_compressed_plan_agreed(tmp_path):
    """A budget roomy enough for compressed probes: the ranks agree on a plan and stay identical."""
    _, stdout = _run(tmp_path, "--steps", "2", "--bits", "2", "--budgeted", "--budget", "4GB", "--count-allreduce")
    assert stdout.count("parameters identical on all 2 ranks: True") == 2, stdout
    plans = {(int(r), int(s)): (k, b, c) for r, s, _, _, k, b, c, _, _ in _STEP.findall(stdout)}
    assert plans[0, 0] == plans[1, 0] and plans[0, 1] == plans[1, 1], stdout
    assert stdout.count("gradient all-reduces 2 in 2 steps") == 2, stdout
