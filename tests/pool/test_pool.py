"""The paged memory pool: accounting, bit-exact round trips, eviction order, spilling, budgets,
grow/shrink policies and concurrent use."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import daftrain  # noqa: F401  (registers the ops)
from daftrain.layout import PackedLayout
from daftrain.pool.store import (
    AdaptiveStep,
    Demand,
    FixedStep,
    PagePool,
    PoolBudgetError,
    PoolConfig,
    PoolError,
    RecordState,
    TrackingStep,
)
from daftrain.saved.records import BoolRecord, QuantizedRecord

PS = 4096  # small pages keep the tests fast and the page arithmetic readable
G = 256


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Page copies are small memcpys; on a loaded 2-core machine OpenMP's parallel copy waits for a
    # descheduled worker (milliseconds per 80 KB copy), so these tests run the copies single-threaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(as_bytes(g), as_bytes(w))


def raw(nbytes: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen),)


def quantized(numel: int, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, bits, G, seed)
    return (lo, scale, codes)


def demoter(numel: int, dtype: torch.dtype = torch.float32, calls: list | None = None):
    """A demote callback for a (lo, scale, codes) payload: decode, re-quantize at half the bits."""

    def demote(payload):
        lo, scale, codes = payload
        bits = codes.shape[1] * 8 // G
        if calls is not None:
            calls.append(bits)
        if bits <= 1:
            return None
        x = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, G, numel, dtype)
        c, lo2, s = torch.ops.daftrain.quantize_pack(x, bits // 2, G, 1234)
        return (lo2, s, c)

    return demote


def pool(**kw) -> PagePool:
    kw.setdefault("page_size", PS)
    kw.setdefault("step", AdaptiveStep(min_step_bytes=16 * PS))
    return PagePool(PoolConfig(**kw))


def assert_empty(p: PagePool) -> None:
    p.check()
    s = p.stats()
    assert s.records == 0 and s.used_bytes == 0 and s.payload_bytes == 0
    assert s.free_pages == s.total_pages and s.spilled_bytes == 0 and s.spilled_records == 0


# -- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 2048},
        {"page_size": 3 * 4096},
        {"page_size": True},
        {"page_size": 4096.0},
        {"initial_bytes": -1},
        {"budget_bytes": 0},
        {"budget_bytes": -4096},
        {"budget_bytes": 4096, "initial_bytes": 8192},
        {"step": "adaptive"},
        {"spill": 1},
        {"spill_dir": 5},
        {"pin_memory": "yes"},
    ],
)
def test_bad_config_rejected(kwargs):
    with pytest.raises(ValueError):
        PoolConfig(**kwargs)


@pytest.mark.parametrize(
    "make",
    [lambda: FixedStep(0), lambda: FixedStep(1.5), lambda: AdaptiveStep(gain=0), lambda: AdaptiveStep(gain=2),
     lambda: AdaptiveStep(deviations=-1), lambda: AdaptiveStep(min_step_bytes=0),
     lambda: TrackingStep(gain=0), lambda: TrackingStep(deviations=-1), lambda: TrackingStep(granule=0),
     lambda: TrackingStep(growth=True), lambda: TrackingStep(min_step_bytes=0), lambda: TrackingStep(gain=2)],
)
def test_bad_step_policy_rejected(make):
    with pytest.raises(ValueError):
        make()


def test_bad_store_arguments_rejected():
    with pool() as p:
        with pytest.raises(TypeError):
            p.store(torch.zeros(3), 1.0)  # a tensor, not a tuple
        with pytest.raises(ValueError):
            p.store((torch.zeros(3),), float("nan"))
        with pytest.raises(TypeError):
            p.store((torch.zeros(3),), 1.0, demote=5)
        with pytest.raises(ValueError):
            p.set_budget(0)
        assert_empty(p)


# -- round trips -----------------------------------------------------------------------------------------


def test_round_trip_random_payloads_bit_exact():
    gen = torch.Generator().manual_seed(0)
    payloads = [
        (torch.randn(1000, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16)),
        (torch.tensor(3.5),),  # 0-dim
        (torch.empty(0), torch.empty(0, 5, dtype=torch.int64)),  # empty
        (torch.rand(33, generator=gen) > 0.5,),  # bool
        (torch.randn(64, 64, generator=gen).t(),),  # non-contiguous
        (torch.randn(3, 5000, generator=gen).half(),
         torch.randint(0, 256, (12345,), dtype=torch.uint8, generator=gen)),
        (torch.tensor([float("nan"), float("inf"), -0.0]),),  # NaN payloads compare by bytes
        (),
    ]
    with pool() as p:
        recs = [p.store(pl, importance=i) for i, pl in enumerate(payloads)]
        for rec, pl in zip(recs, payloads, strict=True):
            assert_same(rec.load(), pl)
            assert_same(rec.load(), pl)  # loading does not free
        for rec in recs:
            rec.release()
        assert_empty(p)


def test_quantized_and_bool_record_payloads_round_trip():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(1))
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, 2, G, 7)
    packed = torch.ops.daftrain.pack_bool(x > 0)
    with pool() as p:
        q = p.store((lo, scale, codes), importance=1.0)
        b = p.store((packed,), importance=1.0)
        lo2, scale2, codes2 = q.load()
        assert_same((lo2, scale2, codes2), (lo, scale, codes))
        rec = QuantizedRecord(codes2, lo2, scale2, PackedLayout(2, G, x.numel()), x.dtype)
        want = QuantizedRecord(codes, lo, scale, PackedLayout(2, G, x.numel()), x.dtype)
        assert torch.equal(rec.decode(), want.decode())
        (packed2,) = b.load()
        assert torch.equal(BoolRecord(packed2, x.numel()).decode(), x > 0)
        s = p.stats()
        assert s.payload_bytes == lo.nbytes + scale.nbytes + codes.nbytes + packed.nbytes
        q.release()
        b.release()
        assert_empty(p)


# -- accounting ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [AdaptiveStep(min_step_bytes=16 * PS), TrackingStep(min_step_bytes=4 * PS)],
                         ids=["adaptive", "tracking"])
def test_page_accounting_never_leaks(step):
    rng = random.Random(0)
    with pool(step=step) as p:
        for step in range(30):
            recs = []
            for i in range(rng.randint(1, 25)):
                n = int(rng.lognormvariate(9 + step % 3, 1.0))
                pl = raw(n, seed=step * 100 + i)
                recs.append((p.store(pl, importance=rng.random()), pl))
            s = p.stats()
            assert s.used_bytes == sum(r.num_pages for r, _ in recs) * PS
            assert s.payload_bytes == sum(r.nbytes for r, _ in recs)
            assert s.free_pages + s.used_bytes // PS == s.total_pages
            p.check()
            rng.shuffle(recs)
            for r, pl in recs:
                if rng.random() < 0.3:
                    assert_same(r.load(), pl)
                r.release()
                r.release()  # idempotent
            p.end_step()
            assert_empty(p)
        assert p.stats().peak_used_bytes > 0


def test_pages_are_reused_in_steady_state():
    with pool() as p:
        sizes = [30_000, 100_000, 5_000, 70_000]
        for step in range(20):
            recs = [p.store(raw(n, n), 1.0) for n in sizes]
            for r in reversed(recs):
                r.release()
            p.end_step()
            if step == 9:  # the adaptive policy has settled (one refit after the first steps)
                events = (p.stats().grow_events, p.stats().shrink_events)
        assert (p.stats().grow_events, p.stats().shrink_events) == events


def test_dropped_handle_releases_its_pages():
    with pool() as p:
        rec = p.store(raw(50_000, 1), 1.0)
        assert p.stats().used_bytes > 0
        del rec
        gc.collect()
        assert_empty(p)


def test_load_after_release_raises():
    with pool() as p:
        rec = p.store(raw(100, 1), 1.0)
        rec.release()
        assert rec.state is RecordState.RELEASED
        with pytest.raises(PoolError, match="released"):
            rec.load()


def test_borrow_yields_views_of_the_pages_and_defers_release():
    with pool(budget_bytes=8 * PS) as p:
        pl = quantized(32_768, 4, 1)
        rec = p.store(pl, 1.0)
        chunk = p._chunks[0].data
        with rec.borrow() as got:
            assert_same(got, pl)
            lo = chunk.data_ptr()
            assert all(lo <= t.data_ptr() < lo + chunk.numel() for t in got)  # views, no copy
            rec.release()  # deferred: the views stay valid inside the block
            assert rec.state is not RecordState.RELEASED and p.stats().used_bytes == 5 * PS
            with pytest.raises(PoolError, match="released"):
                rec.load()
            assert_same(got, pl)
        assert rec.state is RecordState.RELEASED
        assert_empty(p)


def test_borrowed_record_is_never_evicted():
    with pool(budget_bytes=4 * PS) as p:
        a = p.store(raw(2 * PS, 1), 1.0)
        with a.borrow() as got:
            b = p.store(raw(3 * PS, 2), 5.0)  # would evict a, but a is pinned: b is spilled instead
            assert a.state is RecordState.RESIDENT and b.state is RecordState.SPILLED
            assert_same(got, raw(2 * PS, 1))
        c = p.store(raw(3 * PS, 3), 5.0)  # a is evictable again
        assert a.state is RecordState.SPILLED and c.state is RecordState.RESIDENT
        with a.borrow() as got:  # a spilled record: a copy read from its file
            assert_same(got, raw(2 * PS, 1))
        for r in (a, b, c):
            r.release()
        assert_empty(p)


def test_borrow_of_a_record_spanning_chunks_gathers_into_reused_scratch():
    with pool(step=FixedStep(4 * PS)) as p:
        filler = p.store(raw(3 * PS, 0), 1.0)  # chunk 0: 3 of 4 pages
        rec = p.store(raw(6 * PS, 1), 1.0)  # no chunk holds 6 pages: spread over chunks 0..2
        assert len(rec._entry.runs) > 1
        ptrs = []
        for _ in range(3):
            with rec.borrow() as got:
                assert_same(got, raw(6 * PS, 1))
                assert rec._entry.pins == 0  # a copy: the record stays evictable
                ptrs.append(got[0].data_ptr())
        assert len(set(ptrs)) == 1 and p.stats().scratch_bytes == 6 * PS  # one buffer, reused
        with rec.borrow() as a, filler.borrow() as b:  # nested: only rec needs scratch
            assert_same(a, raw(6 * PS, 1))
            assert_same(b, raw(3 * PS, 0))
        filler.release()
        rec.release()
        assert_empty(p)
        p.end_step()
        assert p.stats().scratch_bytes == 6 * PS  # used this step: kept
        p.end_step()
        assert p.stats().scratch_bytes == 0  # a step without straddling borrows: freed


# -- eviction -------------------------------------------------------------------------------------------------


def test_spills_least_important_first():
    # Each record: 2 pages. Budget: 6 pages -> 3 resident records.
    with pool(budget_bytes=6 * PS) as p:
        payloads = {imp: raw(2 * PS - 100, int(imp * 10)) for imp in (5.0, 1.0, 3.0)}
        recs = {imp: p.store(pl, imp) for imp, pl in payloads.items()}
        assert all(r.state is RecordState.RESIDENT for r in recs.values())
        recs[4.0] = p.store(payloads.setdefault(4.0, raw(2 * PS - 100, 40)), 4.0)
        assert recs[1.0].state is RecordState.SPILLED
        assert all(recs[i].state is RecordState.RESIDENT for i in (3.0, 4.0, 5.0))
        recs[2.0] = p.store(payloads.setdefault(2.0, raw(2 * PS - 100, 20)), 2.0)
        assert recs[3.0].state is RecordState.RESIDENT  # more important than the new one: kept
        assert recs[2.0].state is RecordState.SPILLED  # the new one is the least important: spilled
        recs[6.0] = p.store(payloads.setdefault(6.0, raw(4 * PS - 100, 60)), 6.0)  # 4 pages: evicts 3 and 4
        assert [i for i, r in sorted(recs.items()) if r.state is RecordState.SPILLED] == [1.0, 2.0, 3.0, 4.0]
        s = p.stats()
        assert s.spills == 4 and s.used_bytes <= 6 * PS and s.spilled_records == 4
        for imp, r in recs.items():  # everything still loads bit-exact
            assert_same(r.load(), payloads[imp])
            r.release()
        assert_empty(p)


def test_equal_importance_evicts_the_older_record_first():
    with pool(budget_bytes=4 * PS) as p:
        a, b = p.store(raw(2 * PS, 1), 1.0), p.store(raw(2 * PS, 2), 1.0)
        c = p.store(raw(2 * PS, 3), 1.0)
        assert (a.state, b.state, c.state) == (RecordState.SPILLED, RecordState.RESIDENT, RecordState.RESIDENT)


def test_demotes_least_important_down_its_ladder_then_spills_it():
    numel = 32_768  # 4 bits: 17152-byte stream = 5 pages; 2 bits: 3 pages; 1 bit: 2 pages
    calls: list[int] = []
    x1 = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    with pool(budget_bytes=15 * PS) as p:
        pls = {imp: quantized(numel, 4, imp) for imp in (1, 2, 3)}
        recs = {imp: p.store(pls[imp], imp, demote=demoter(numel, calls=calls)) for imp in (3, 1, 2)}
        assert p.stats().used_bytes == 15 * PS
        # 2 more pages are needed: the least important record (1) is demoted 4 -> 2 bits (frees 2).
        mid = p.store(raw(2 * PS, 5), 5.0)
        assert calls == [4] and recs[1].state is RecordState.DEMOTED and recs[1].demotions == 1
        assert recs[2].state is recs[3].state is RecordState.RESIDENT
        lo, scale, codes = recs[1].load()
        assert codes.shape[1] * 8 // G == 2  # the demoted payload, at 2 bits
        approx = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, 2, G, numel, torch.float32)
        assert (approx - x1).abs().max() <= (x1.max() - x1.min()) / 3 + 1e-6  # one 2-bit step
        # 3 more: record 1 again (2 -> 1 bit frees 1), then it is at its floor and is spilled (frees 2);
        # records 2 and 3, more important, are untouched.
        top = p.store(raw(3 * PS, 10), 10.0)
        assert calls == [4, 2, 1]
        assert recs[1].state is RecordState.SPILLED and recs[1].demotions == 2
        assert recs[2].state is recs[3].state is RecordState.RESIDENT
        s = p.stats()
        assert (s.demotions, s.spills, s.used_bytes) == (2, 1, 15 * PS)
        assert recs[1].load()[2].shape[1] * 8 // G == 1
        for i in (2, 3):
            assert_same(recs[i].load(), pls[i])
        assert_same(mid.load(), raw(2 * PS, 5))
        assert_same(top.load(), raw(3 * PS, 10))
        p.check()
    assert p.stats().records == 0


def test_demote_callback_returning_none_falls_back_to_spill():
    with pool(budget_bytes=4 * PS) as p:
        a = p.store(raw(3 * PS, 1), 1.0, demote=lambda payload: None)
        b = p.store(raw(3 * PS, 2), 2.0)
        assert a.state is RecordState.SPILLED and b.state is RecordState.RESIDENT
        assert p.stats().demotions == 0 and p.stats().spills == 1
        assert_same(a.load(), raw(3 * PS, 1))


def test_new_record_demoted_when_it_is_the_least_important():
    numel = 32_768
    with pool(budget_bytes=8 * PS, spill=False) as p:
        big = p.store(quantized(numel, 4, 1), 5.0)  # 5 pages
        small = p.store(quantized(numel, 4, 2), 1.0, demote=demoter(numel))  # 5 pages do not fit, 3 do
        assert small.state is RecordState.DEMOTED and big.state is RecordState.RESIDENT
        assert small.load()[2].shape[1] * 8 // G == 2
        calls: list[int] = []
        with pytest.raises(PoolBudgetError):  # no page left even at 1 bit, nothing to evict
            p.store(quantized(numel, 4, 3), 0.5, demote=demoter(numel, calls=calls))
        assert calls == [4, 2, 1]
    with pool(budget_bytes=8 * PS) as p:
        p_big = p.store(quantized(numel, 4, 1), 5.0)
        p_mid = p.store(raw(3 * PS, 0), 4.0)
        tiny_payload = quantized(numel, 4, 3)
        tiny = p.store(tiny_payload, 0.5, demote=demoter(numel))  # never fits: spilled as given
        assert tiny.state is RecordState.SPILLED and tiny.demotions == 0
        assert_same(tiny.load(), tiny_payload)
        assert p_big.state is p_mid.state is RecordState.RESIDENT


def test_spill_and_page_in_are_bit_exact():
    with pool(budget_bytes=4 * PS) as p:
        pl_a, pl_b = raw(3 * PS + 17, 1), raw(3 * PS, 2)
        a = p.store(pl_a, 1.0)
        b = p.store(pl_b, 2.0)
        assert a.state is RecordState.SPILLED and a.num_pages == 0
        assert p.stats().spilled_bytes > 3 * PS
        assert_same(a.load(), pl_a)  # no room without evicting b: read from the file
        assert a.state is RecordState.SPILLED and p.stats().page_ins == 0
        b.release()
        assert_same(a.load(page_in=False), pl_a)  # backward's last use: stays in its file
        assert a.state is RecordState.SPILLED and p.stats().page_ins == 0
        assert_same(a.load(), pl_a)  # now it fits: paged back in on load
        assert a.state is RecordState.RESIDENT and p.stats().page_ins == 1
        assert_same(a.load(), pl_a)
        a.release()
        assert_empty(p)


def test_prefetch_pages_in_and_evicts_less_important():
    with pool(budget_bytes=4 * PS) as p:
        pl = {i: raw(2 * PS, i) for i in range(4)}
        r = {i: p.store(pl[i], float(i)) for i in (3, 1, 2)}  # 3, 1 resident; 2 spills 1
        r[0] = p.store(pl[0], 0.0)  # least important: spilled
        assert r[1].state is RecordState.SPILLED and r[0].state is RecordState.SPILLED
        assert not p.prefetch(r[0])  # would need to evict more important records
        assert p.prefetch(r[1]) is False  # record 1 < 2 and 3
        p.set_budget(6 * PS)
        assert p.prefetch(r[1]) and r[1].state is RecordState.RESIDENT
        assert p.stats().page_ins == 1
        for i, rec in r.items():
            assert_same(rec.load(), pl[i])
            rec.release()
        assert_empty(p)


def test_corrupted_spill_file_raises_pool_error(tmp_path: Path):
    with pool(budget_bytes=2 * PS, spill_dir=tmp_path) as p:
        a = p.store(raw(2 * PS, 1), 1.0)
        b = p.store(raw(2 * PS, 2), 2.0)
        c = p.store(raw(2 * PS, 3), 0.5)
        assert a.state is RecordState.SPILLED and c.state is RecordState.SPILLED
        files = sorted(tmp_path.iterdir())
        assert len(files) == 2
        data = bytearray(files[0].read_bytes())
        data[100] ^= 0x01  # one flipped bit in the body
        files[0].write_bytes(bytes(data))
        with pytest.raises(PoolError, match="corrupted"):
            a.load()
        files[1].write_bytes(files[1].read_bytes()[:-10])  # truncated
        with pytest.raises(PoolError, match="truncated"):
            c.load()
        files[1].unlink()
        with pytest.raises(PoolError, match="missing"):
            p.prefetch(c)
        assert_same(b.load(), raw(2 * PS, 2))
        for r in (a, b, c):
            r.release()
        assert_empty(p)
    assert list(tmp_path.iterdir()) == []


def test_budget_error_reports_the_numbers():
    with pool(budget_bytes=4 * PS, spill=False) as p:
        keep = p.store(raw(3 * PS, 1), 5.0)
        with pytest.raises(PoolBudgetError) as info:
            p.store(raw(2 * PS, 2), 1.0)
        msg = str(info.value)
        assert f"{2 * PS} bytes" in msg and f"allows {4 * PS} bytes" in msg and f"{3 * PS} bytes are in use" in msg
        assert (info.value.requested_bytes, info.value.budget_bytes, info.value.used_bytes) == (2 * PS, 4 * PS, 3 * PS)
        with pytest.raises(PoolBudgetError, match=f"{5 * PS} bytes"):
            p.store(raw(5 * PS, 3), 9.0)  # larger than the whole budget
        assert keep.state is RecordState.RESIDENT  # nothing was evicted for a hopeless store
        assert_same(keep.load(), raw(3 * PS, 1))
        keep.release()
        assert_empty(p)


def test_lower_budget_makes_next_store_evict():
    with pool() as p:
        recs = [p.store(raw(2 * PS, i), float(i)) for i in range(5)]
        assert p.stats().spills == 0
        p.set_budget(6 * PS)
        assert all(r.state is RecordState.RESIDENT for r in recs)  # lazy: nothing evicted yet
        new = p.store(raw(PS, 9), 9.0)
        assert [r.state for r in recs] == [RecordState.SPILLED] * 3 + [RecordState.RESIDENT] * 2
        assert new.state is RecordState.RESIDENT and p.stats().used_bytes <= 6 * PS
        for r in recs + [new]:
            r.release()
        p.end_step()
        assert p.stats().reserved_bytes <= 6 * PS  # trailing free chunks above the budget are gone


# -- grow / shrink --------------------------------------------------------------------------------------------


def run_step(p: PagePool, nbytes: list[int]) -> None:
    recs = [p.store(raw(n, 0), 1.0) for n in nbytes]
    for r in reversed(recs):
        r.release()
    p.end_step()


def test_fixed_step_grows_and_shrinks_in_steps():
    step = 16 * PS
    with pool(step=FixedStep(step)) as p:
        run_step(p, [10 * PS] * 5)  # 50 pages -> 4 chunks of 16
        s = p.stats()
        assert s.reserved_bytes == 4 * step and s.grow_events == 4 and s.chunks == 4
        run_step(p, [10 * PS] * 2)  # peak 20 pages: keep 2 chunks
        s = p.stats()
        assert s.reserved_bytes == 2 * step and s.shrink_events == 2
        run_step(p, [10 * PS] * 2)
        assert p.stats().grow_events == 4 and p.stats().shrink_events == 2  # steady: nothing moves
        p.set_budget(step)
        assert p.stats().reserved_bytes == step and p.stats().shrink_events == 3


def test_fixed_step_growth_is_capped_by_the_budget():
    with pool(step=FixedStep(100 * PS), budget_bytes=30 * PS) as p:
        r = p.store(raw(PS, 0), 1.0)
        assert p.stats().reserved_bytes == 30 * PS
        r.release()


def test_adaptive_step_follows_demand():
    policy = AdaptiveStep(min_step_bytes=4 * PS)

    def near(reserved: int, pages: int) -> bool:
        # at least the demand, at most one chunk (granule) plus the hysteresis slack above it
        return pages * PS <= reserved <= pages * PS * (1 + policy.granule + policy.slack) + PS

    with pool(step=policy) as p:
        for _ in range(20):
            run_step(p, [20 * PS] * 5)  # 100 pages a step
        s = p.stats()
        assert near(s.reserved_bytes, 100)  # target -> mean, deviation -> 0
        grows = s.grow_events
        for _ in range(20):
            run_step(p, [20 * PS] * 5)
        assert p.stats().grow_events == grows  # steady state: no allocation
        for _ in range(30):
            run_step(p, [20 * PS] * 2)  # demand drops to 40 pages
        s = p.stats()
        assert s.shrink_events > 0 and near(s.reserved_bytes, 40)
        for _ in range(30):
            run_step(p, [20 * PS] * 8)  # and rises to 160
        s = p.stats()
        assert s.grow_events > grows and near(s.reserved_bytes, 160)
        assert s.peak_reserved_bytes >= s.reserved_bytes


def test_tracking_step_growth_covers_the_shortfall():
    policy = TrackingStep()
    rng = random.Random(0)
    for _ in range(200):
        mean = rng.uniform(0, 64 * 2**20)
        demand = Demand(rng.choice([0, 1, 50]), int(mean), mean, rng.uniform(0, mean / 2))
        shortfall, reserved = rng.randint(1, 32 * 2**20), rng.randint(0, 128 * 2**20)
        sizes = policy.plan_growth(shortfall, reserved, demand)
        assert sizes and all(n > 0 for n in sizes) and sum(sizes) >= shortfall
        if demand.steps:  # one chunk for the shortfall, then granules up to the floor
            granule = policy.granule_bytes(demand)
            assert sizes[0] == max(shortfall, granule) and all(n == granule for n in sizes[1:])
            assert reserved + sum(sizes) < max(policy.keep_bytes(demand), reserved + sizes[0]) + granule


def test_tracking_step_follows_each_step_peak():
    policy = TrackingStep(min_step_bytes=4 * PS)  # the granule is 4 pages at these sizes (mean / 32 < 4)
    granule = 4 * PS
    with pool(step=policy) as p:
        for _ in range(30):
            run_step(p, [4 * PS] * 25)  # 100 pages a step
        s = p.stats()
        # steady workload: the floor has converged to the peak; only whole chunks are freed, so the
        # pool keeps the shortest prefix of its chunks that holds it (the first step's chunks: 4 pages)
        assert 100 * PS <= s.reserved_bytes < 100 * PS + granule
        events = (s.grow_events, s.shrink_events)
        for _ in range(10):
            run_step(p, [4 * PS] * 25)
        assert (p.stats().grow_events, p.stats().shrink_events) == events  # and nothing moves
        recs = [p.store(raw(PS, i), 1.0) for i in range(160)]  # a busy step: 160 pages
        s = p.stats()
        assert s.used_bytes == 160 * PS and s.reserved_bytes - s.used_bytes < granule  # tracked the peak
        assert s.grow_events > events[0]
        for r in recs:
            r.release()
        p.end_step()
        s = p.stats()
        keep = policy.keep_bytes(Demand(1, 0, 100 * PS + 60 * PS / 8, 60 * PS / 4))
        assert s.shrink_events > events[1] and keep <= s.reserved_bytes < keep + granule  # given back
        for _ in range(40):
            run_step(p, [4 * PS] * 10)  # demand drops to 40 pages
        assert 40 * PS <= p.stats().reserved_bytes < 40 * PS + granule
        for _ in range(40):
            run_step(p, [4 * PS] * 40)  # and rises to 160
        s = p.stats()
        assert 160 * PS <= s.reserved_bytes < 160 * PS + granule
        p.check()
        assert_empty(p)


def test_shrinking_returns_memory_to_the_os():
    from daftrain.budget.memory import current_rss_bytes

    chunk = 64 << 20
    with pool(page_size=64 << 10, step=FixedStep(chunk)) as p:
        before = current_rss_bytes()
        rec = p.store(raw(4096, 0), 1.0)
        grown = current_rss_bytes()
        assert grown - before > chunk * 0.9  # reserved = resident: faulted in when reserved
        rec.release()
        p.end_step()  # the step peaked at one page: the chunk is kept
        assert p.stats().reserved_bytes == chunk
        p.end_step()  # an idle step: nothing to keep
        assert p.stats().reserved_bytes == 0
        assert grown - current_rss_bytes() > chunk * 0.9  # and given back, not kept by malloc


def test_initial_bytes_are_reserved_up_front():
    with pool(initial_bytes=10 * PS + 1) as p:
        s = p.stats()
        assert s.reserved_bytes == 11 * PS and s.grow_events == 1
        r = p.store(raw(11 * PS, 0), 1.0)
        assert p.stats().grow_events == 1
        r.release()


# -- lifecycle -----------------------------------------------------------------------------------------------


def test_close_removes_the_private_spill_dir():
    p = pool(budget_bytes=2 * PS)
    a = p.store(raw(2 * PS, 1), 1.0)
    p.store(raw(2 * PS, 2), 0.5)  # spilled (and its handle dropped: its file goes too)
    assert a.state is RecordState.RESIDENT
    b = p.store(raw(2 * PS, 3), 2.0)
    assert a.state is RecordState.SPILLED and b.state is RecordState.RESIDENT
    spill_dir = Path(a._entry.spill_path).parent
    assert len(os.listdir(spill_dir)) == 1
    p.close()
    assert not spill_dir.exists()
    with pytest.raises(PoolError, match="closed"):
        a.load()
    with pytest.raises(PoolError, match="closed"):
        p.store(raw(1, 1), 1.0)
    assert not p.pinned


# -- concurrency ------------------------------------------------------------------------------------------------


def test_concurrent_store_load_release_keeps_accounting():
    numel = 16_384
    with pool(budget_bytes=64 * PS) as p:
        errors: list[BaseException] = []
        quantized(numel, 4, 0)  # warm the kernels up before the clock starts
        start = time.monotonic()
        soft, hard = start + 1.0, start + 4.0  # at least 60 iterations per thread, at most 4 s

        def worker(tid: int) -> None:
            rng = random.Random(tid)
            live: list[tuple] = []
            try:
                i = 0
                while (i < 60 or time.monotonic() < soft) and time.monotonic() < hard:
                    i += 1
                    if rng.random() < 0.25:
                        pl = quantized(numel, 4, tid * 100_000 + i)
                        rec = p.store(pl, rng.random(), demote=demoter(numel))
                    else:
                        pl = raw(rng.randint(1, 6 * PS), tid * 100_000 + i)
                        rec = p.store(pl, rng.random())
                    live.append((rec, pl))
                    if rng.random() < 0.1:
                        p.prefetch(rng.choice(live)[0])
                    while len(live) > 8 or (live and rng.random() < 0.3):
                        rec, pl = live.pop(rng.randrange(len(live)))
                        if rng.random() < 0.5:
                            got = rec.load(page_in=rng.random() < 0.5)
                            if rec.demotions == 0:
                                assert_same(got, pl)
                            rec.release()
                        else:
                            with rec.borrow() as got:
                                if rec.demotions == 0:
                                    assert_same(got, pl)
                                rec.release()  # inside the block: deferred to its end
                for rec, _ in live:
                    rec.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        s = p.stats()
        assert s.spills > 0  # the budget was actually contended
        assert s.peak_used_bytes <= 64 * PS
        assert_empty(p)
