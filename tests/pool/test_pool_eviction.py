"""The paged memory pool under its byte cap: eviction order, demotion, spilling and paging back in."""

from __future__ import annotations

import pytest
import torch
from pool_helpers import PS, G, assert_empty, assert_same, demoter, pool, quantized, raw

import daftrain  # noqa: F401  (registers the ops)
from daftrain.pool import PoolBudgetError, RecordState

# -- eviction -------------------------------------------------------------------------------------------------


def test_spills_least_important_first():
    # Each record: 2 pages. max_bytes: 6 pages -> 3 resident records.
    with pool(max_bytes=6 * PS) as p:
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
    with pool(max_bytes=4 * PS) as p:
        a, b = p.store(raw(2 * PS, 1), 1.0), p.store(raw(2 * PS, 2), 1.0)
        c = p.store(raw(2 * PS, 3), 1.0)
        assert (a.state, b.state, c.state) == (RecordState.SPILLED, RecordState.RESIDENT, RecordState.RESIDENT)


def test_demotes_least_important_down_its_ladder_then_spills_it():
    numel = 32_768  # 4 bits: 17152-byte stream = 5 pages; 2 bits: 3 pages; 1 bit: 2 pages
    calls: list[int] = []
    x1 = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    with pool(max_bytes=15 * PS) as p:
        pls = {imp: quantized(numel, 4, imp) for imp in (1, 2, 3)}
        recs = {imp: p.store(pls[imp], imp, demote=demoter(numel, calls=calls)) for imp in (3, 1, 2)}
        assert p.stats().used_bytes == 15 * PS
        # 2 more pages are needed: the least important record (1) is demoted 4 -> 2 bits (frees 2).
        mid = p.store(raw(2 * PS, 5), 5.0)
        assert calls == [4] and recs[1].state is RecordState.DEMOTED and recs[1].demotions == 1
        assert recs[2].state is recs[3].state is RecordState.RESIDENT
        codes, lo, scale = recs[1].load()
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
        assert recs[1].load()[0].shape[1] * 8 // G == 1
        for i in (2, 3):
            assert_same(recs[i].load(), pls[i])
        assert_same(mid.load(), raw(2 * PS, 5))
        assert_same(top.load(), raw(3 * PS, 10))
        p.check()
    assert p.stats().records == 0


def test_demote_callback_returning_none_falls_back_to_spill():
    with pool(max_bytes=4 * PS) as p:
        a = p.store(raw(3 * PS, 1), 1.0, demote=lambda payload: None)
        b = p.store(raw(3 * PS, 2), 2.0)
        assert a.state is RecordState.SPILLED and b.state is RecordState.RESIDENT
        assert p.stats().demotions == 0 and p.stats().spills == 1
        assert_same(a.load(), raw(3 * PS, 1))


def test_new_record_demoted_when_it_is_the_least_important():
    numel = 32_768
    with pool(max_bytes=8 * PS, spill=False) as p:
        big = p.store(quantized(numel, 4, 1), 5.0)  # 5 pages
        small = p.store(quantized(numel, 4, 2), 1.0, demote=demoter(numel))  # 5 pages do not fit, 3 do
        assert small.state is RecordState.DEMOTED and big.state is RecordState.RESIDENT
        assert small.load()[0].shape[1] * 8 // G == 2
        calls: list[int] = []
        with pytest.raises(PoolBudgetError):  # no page left even at 1 bit, nothing to evict
            p.store(quantized(numel, 4, 3), 0.5, demote=demoter(numel, calls=calls))
        assert calls == [4, 2, 1]
    with pool(max_bytes=8 * PS) as p:
        p_big = p.store(quantized(numel, 4, 1), 5.0)
        p_mid = p.store(raw(3 * PS, 0), 4.0)
        tiny_payload = quantized(numel, 4, 3)
        tiny = p.store(tiny_payload, 0.5, demote=demoter(numel))  # never fits: spilled as given
        assert tiny.state is RecordState.SPILLED and tiny.demotions == 0
        assert_same(tiny.load(), tiny_payload)
        assert p_big.state is p_mid.state is RecordState.RESIDENT


def test_spill_and_page_in_are_bit_exact():
    with pool(max_bytes=4 * PS) as p:
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
    with pool(max_bytes=4 * PS) as p:
        pl = {i: raw(2 * PS, i) for i in range(4)}
        r = {i: p.store(pl[i], float(i)) for i in (3, 1, 2)}  # 3, 1 resident; 2 spills 1
        r[0] = p.store(pl[0], 0.0)  # least important: spilled
        assert r[1].state is RecordState.SPILLED and r[0].state is RecordState.SPILLED
        assert not p.prefetch(r[0])  # would need to evict more important records
        assert p.prefetch(r[1]) is False  # record 1 < 2 and 3
        p.set_max_bytes(6 * PS)
        assert p.prefetch(r[1]) and r[1].state is RecordState.RESIDENT
        assert p.stats().page_ins == 1
        for i, rec in r.items():
            assert_same(rec.load(), pl[i])
            rec.release()
        assert_empty(p)


def test_max_bytes_error_reports_the_numbers():
    with pool(max_bytes=4 * PS, spill=False) as p:
        keep = p.store(raw(3 * PS, 1), 5.0)
        with pytest.raises(PoolBudgetError) as info:
            p.store(raw(2 * PS, 2), 1.0)
        msg = str(info.value)
        assert f"{2 * PS} bytes" in msg and f"allows {4 * PS} bytes" in msg and f"{3 * PS} bytes are in use" in msg
        assert (info.value.requested_bytes, info.value.max_bytes, info.value.used_bytes) == (2 * PS, 4 * PS, 3 * PS)
        with pytest.raises(PoolBudgetError, match=f"{5 * PS} bytes"):
            p.store(raw(5 * PS, 3), 9.0)  # larger than the whole cap
        assert keep.state is RecordState.RESIDENT  # nothing was evicted for a hopeless store
        assert_same(keep.load(), raw(3 * PS, 1))
        keep.release()
        assert_empty(p)


def test_lower_max_bytes_makes_next_store_evict():
    with pool() as p:
        recs = [p.store(raw(2 * PS, i), float(i)) for i in range(5)]
        assert p.stats().spills == 0
        p.set_max_bytes(6 * PS)
        assert all(r.state is RecordState.RESIDENT for r in recs)  # lazy: nothing evicted yet
        new = p.store(raw(PS, 9), 9.0)
        assert [r.state for r in recs] == [RecordState.SPILLED] * 3 + [RecordState.RESIDENT] * 2
        assert new.state is RecordState.RESIDENT and p.stats().used_bytes <= 6 * PS
        for r in [*recs, new]:
            r.release()
        p.end_step()
        assert p.stats().reserved_bytes <= 6 * PS  # trailing free chunks above the cap are gone


