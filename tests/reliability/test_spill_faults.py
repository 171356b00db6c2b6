"""End to end: training steps through ``compress(pool=...)`` under a byte cap small enough to spill every
step, while the spill directory is deleted mid-run. The step that needs it raises ``PoolError`` naming the
directory (or the file in it), no record is lost track of, and once the directory is back the next step
trains normally. The pool-level faults (unwritable, full, corrupted, replaced by a file) are in
tests/pool/test_pool_spill_files.py."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daftrain
from daftrain import PagePool, PoolConfig, PoolError

PAGE = 4096
CAP = 16 * PAGE  # the MLP below saves ~0.5 MB per step at 8 bits: most of it is demoted or spilled


def _setup(spill_dir: Path) -> tuple[nn.Module, PagePool, daftrain.compress, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    pool = PagePool(PoolConfig(page_size=PAGE, max_bytes=CAP, spill_dir=spill_dir))
    ctx = daftrain.compress(bits=8, model=model, pool=pool, seed=0)
    return model, pool, ctx, (torch.randn(64, 256), torch.randint(0, 10, (64,)))


def _step(model: nn.Module, ctx: daftrain.compress, batch) -> list[torch.Tensor]:
    with ctx:
        loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _private_dir(spill_dir: Path) -> Path:
    (d,) = spill_dir.iterdir()
    return d


def _assert_consistent(pool: PagePool) -> None:
    gc.collect()  # the failed step's graph, held by the exception's traceback until now
    pool.check()
    assert pool.stats().records == 0  # every record of the failed step was released


@pytest.mark.parametrize("when", ["between steps", "between forward and backward"])
def test_spill_dir_deleted_mid_run_raises_pool_error_and_training_resumes_once_restored(tmp_path, when):
    spill_dir = tmp_path / "spill"
    model, pool, ctx, batch = _setup(spill_dir)
    for _ in range(3):
        _step(model, ctx, batch)
    spills = pool.stats().spills
    assert spills > 0, "the cap is meant to force spilling"
    private = _private_dir(spill_dir)

    if when == "between steps":
        shutil.rmtree(spill_dir)
        with pytest.raises(PoolError, match="cannot create spill file") as info:
            _step(model, ctx, batch)  # the forward must spill
        assert f"spill directory {private} must stay in place" in str(info.value)
    else:
        with ctx:
            loss = F.cross_entropy(model(batch[0]), batch[1])
        shutil.rmtree(spill_dir)
        with pytest.raises(PoolError, match="is missing") as info:
            loss.backward()  # a spilled record's file is gone
        assert str(private) in str(info.value) and "spill_dir" in str(info.value)
        del loss
        model.zero_grad()
    del info
    _assert_consistent(pool)

    os.makedirs(private, mode=0o700)  # the directory the error named is back
    grads = _step(model, ctx, batch)
    assert pool.stats().spills > spills
    assert all(torch.isfinite(g).all() for g in grads)
    # The same step of an undisturbed run (the rounding stream depends on the step index only).
    model2, _, ctx2, _ = _setup(tmp_path / "spill2")
    for _ in range(ctx.step):
        _step(model2, ctx2, batch)
    for g, ref in zip(grads, _step(model2, ctx2, batch), strict=True):
        assert torch.equal(g, ref)
    _assert_consistent(pool)
