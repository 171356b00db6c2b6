"""The paged memory pool: configuration, accounting, bit-exact round trips, borrowing, lifecycle and
concurrent use."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from pool_helpers import PS, G, assert_empty, assert_same, demoter, pool, quantized, raw

import daftrain  # noqa: F401  (registers the ops)
from daftrain.pool import AdaptiveGrowth, FixedGrowth, PoolConfig, PoolError, RecordState, TrackingGrowth
from daftrain.saved.records import PackedRecord

# -- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 2048},
        {"page_size": 3 * 4096},
        {"page_size": True},
        {"page_size": 4096.0},
        {"initial_bytes": -1},
        {"max_bytes": 0},
        {"max_bytes": -4096},
        {"max_bytes": 4096, "initial_bytes": 8192},
        {"growth": "adaptive"},
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
    [lambda: FixedGrowth(0), lambda: FixedGrowth(1.5), lambda: AdaptiveGrowth(gain=0), lambda: AdaptiveGrowth(gain=2),
     lambda: AdaptiveGrowth(deviations=-1), lambda: AdaptiveGrowth(min_step_bytes=0),
     lambda: TrackingGrowth(gain=0), lambda: TrackingGrowth(deviations=-1), lambda: TrackingGrowth(granule=0),
     lambda: TrackingGrowth(growth=True), lambda: TrackingGrowth(min_step_bytes=0), lambda: TrackingGrowth(gain=2)],
)
def test_bad_growth_policy_rejected(make):
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
            p.set_max_bytes(0)
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
        q = p.store((codes, lo, scale), importance=1.0)
        b = p.store((packed,), importance=1.0)
        codes2, lo2, scale2 = q.load()
        assert_same((codes2, lo2, scale2), (codes, lo, scale))
        rec = PackedRecord.quantized((codes2, lo2, scale2), x.numel(), G, x.dtype)
        want = PackedRecord.quantized((codes, lo, scale), x.numel(), G, x.dtype)
        assert torch.equal(rec.decode(), want.decode())
        (packed2,) = b.load()
        assert torch.equal(PackedRecord.bitmap(packed2, x.numel()).decode(), x > 0)
        s = p.stats()
        assert s.payload_bytes == lo.nbytes + scale.nbytes + codes.nbytes + packed.nbytes
        q.release()
        b.release()
        assert_empty(p)


# -- accounting ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("growth", [AdaptiveGrowth(min_step_bytes=16 * PS), TrackingGrowth(min_step_bytes=4 * PS)],
                         ids=["adaptive", "tracking"])
def test_page_accounting_never_leaks(growth):
    rng = random.Random(0)
    with pool(growth=growth) as p:
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
    with pool(max_bytes=8 * PS) as p:
        pl = quantized(32_768, 4, 1)
        rec = p.store(pl, 1.0)
        chunk = p._pages.chunks[0].data
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
    with pool(max_bytes=4 * PS) as p:
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
    with pool(growth=FixedGrowth(4 * PS)) as p:
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


# -- lifecycle -----------------------------------------------------------------------------------------------


def test_close_removes_the_private_spill_dir():
    p = pool(max_bytes=2 * PS)
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
    with pool(max_bytes=64 * PS) as p:
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
        assert s.spills > 0  # the cap was actually contended
        assert s.peak_used_bytes <= 64 * PS
        assert_empty(p)
