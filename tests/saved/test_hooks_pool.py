"""compress(pool=...): records in a PagePool give the same gradients, return every page, and under a
tight budget are demoted or spilled, never lost."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from helpers import grads_of, sqnr_db
from torch import nn

import daftrain
from daftrain.pool.store import PagePool, PoolBudgetError, PoolConfig

KIB = 1 << 10


class Clip(nn.Module):
    """``masked_fill`` saves a bool mask: a record of the bool kind."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x < -1.0, -1.0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), Clip(), nn.ReLU(), nn.Dropout(0.1),
        nn.Flatten(), nn.Linear(16 * 16 * 16, 10),
    )


def _grads(model: nn.Module, ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the dropout mask
    with ctx:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return grads_of(model)


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(16, 3, 16, 16, generator=gen), torch.randint(0, 10, (16,), generator=gen)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_pooled_gradients_are_identical_and_pages_return(batch, asynchronous: bool, device: str) -> None:
    model = _model().to(device)
    batch = tuple(t.to(device) for t in batch)
    plain = _grads(model, daftrain.compress(bits=2, seed=5, asynchronous=asynchronous), *batch)
    with PagePool(PoolConfig(page_size=16 * KIB)) as pool:
        ctx = daftrain.compress(bits=2, seed=5, pool=pool, asynchronous=asynchronous)
        for _ in range(3):  # the pool is reused step after step
            ctx.step = -1  # same seeds every step: the gradients must match the unpooled run
            pooled = _grads(model, ctx, *batch)
            assert torch.equal(pooled, plain)
            stats = ctx.stats
            assert stats.compressed > 0 and stats.bool_packed > 0
        gc.collect()
        s = pool.stats()
        assert s.records == 0 and s.used_bytes == 0, s  # every page came back once backward was done
        assert s.reserved_bytes > 0 and s.evictions == 0
        pool.check()
        ctx.close()


def test_tight_budget_demotes_then_spills_and_backward_still_gets_valid_tensors(batch) -> None:
    model = _model()
    exact = _grads(model, daftrain.compress(bits=None), *batch)
    ref8 = _grads(model, daftrain.compress(bits=8, seed=3), *batch)
    # 8-bit records of this model take ~290 KiB of pages; allow 48 KiB so most must be evicted.
    with PagePool(PoolConfig(page_size=4 * KIB, max_bytes=48 * KIB)) as pool:
        ctx = daftrain.compress(bits=8, seed=3, pool=pool)
        got = _grads(model, ctx, *batch)
        s = pool.stats()
        assert s.evictions > 0 and s.peak_used_bytes <= 48 * KIB
        assert torch.isfinite(got).all()
        # Demoted records carry fewer bits: more noise than 8 bits, but still a gradient (2-bit floor).
        assert sqnr_db(exact, got) > 3.0
        assert sqnr_db(exact, ref8) > sqnr_db(exact, got) - 1.0
        ctx.close()


def test_demotion_is_least_important_first(batch) -> None:
    """Records are ordered by forward position: the first saved is demoted first."""
    model = _model()
    with PagePool(PoolConfig(page_size=4 * KIB, max_bytes=160 * KIB, spill=False)) as pool:
        ctx = daftrain.compress(bits=8, seed=3, pool=pool)
        model.zero_grad(set_to_none=True)
        with ctx:
            out = model(batch[0])
        entries = sorted(pool._live.values(), key=lambda e: e.key)  # white-box: the pool's own records
        quantized = [e.demotions for e in entries if e.demote is not None]
        assert quantized[0] > 0  # the first saved was demoted ...
        assert quantized == sorted(quantized, reverse=True)  # ... and the less important more than later ones
        F.cross_entropy(out, batch[1]).backward()
        ctx.close()


def test_budget_that_cannot_fit_raises_a_clear_error(batch) -> None:
    model = _model()
    with PagePool(PoolConfig(page_size=4 * KIB, max_bytes=8 * KIB, spill=False)) as pool:
        ctx = daftrain.compress(bits=2, pool=pool)
        with pytest.raises(PoolBudgetError, match=r"max_bytes allows 8192 bytes"):
            with ctx:
                model(batch[0])
        ctx.close()


def test_pool_must_be_a_page_pool() -> None:
    with pytest.raises(TypeError, match="PagePool"):
        daftrain.compress(pool=object())


def test_auto_bits_gives_the_pool_variance_based_importance(batch) -> None:
    """With bits="auto", once bits are allocated, a pooled record's importance is its slot's
    estimated gradient variance (from ``ctx.report()``), not its forward position."""
    model = _model()
    with PagePool(PoolConfig(page_size=4 * KIB)) as pool:
        ctx = daftrain.compress(bits="auto", avg_bits=2.0, seed=3, pool=pool, model=model)
        _grads(model, ctx, *batch)  # the adaptation step
        _grads(model, ctx, *batch)
        report = ctx.report()
        assert report is not None
        variances = sorted(a.variance for a in report.slots if a.bits is not None)
        model.zero_grad(set_to_none=True)
        with ctx:
            out = model(batch[0])
        quantized = sorted(e.importance for e in pool._live.values() if e.demote is not None)
        # Every allocated slot carries its variance; the one other quantized record is the dropout
        # mask, stored losslessly at 1 bit outside the allocation, which keeps its forward position.
        assert [v for v in quantized if v in variances] == variances
        assert len(quantized) == len(variances) + 1
        F.cross_entropy(out, batch[1]).backward()
        ctx.close()


class _Attention(nn.Module):
    """A layer norm over 96 features (normalised records, restored with their statistics) and attention
    written out (a softmax's records, restored with rows that sum to 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(48, 96), nn.LayerNorm(96), nn.Linear(96, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x.reshape(x.shape[0], 16, 48)))  # 16 tokens of 48 values per sample
        p = torch.softmax(h @ h.transpose(1, 2) / 8.0, dim=-1)
        return self.head((p @ h).mean(1))


def test_restoring_records_in_the_pool_give_the_same_gradients(batch) -> None:
    torch.manual_seed(0)
    model = _Attention()
    plain = _grads(model, daftrain.compress(bits=2, seed=5), *batch)
    with PagePool(PoolConfig(page_size=16 * KIB)) as pool:
        ctx = daftrain.compress(bits=2, seed=5, pool=pool)
        ctx.step = -1
        assert torch.equal(_grads(model, ctx, *batch), plain)
        gc.collect()
        s = pool.stats()
        assert s.records == 0 and s.used_bytes == 0, s
        pool.check()
        ctx.close()
