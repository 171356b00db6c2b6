"""The paged memory pool's growth policies: how it grows and shrinks its reservation."""

from __future__ import annotations

import random

from pool_helpers import PS, assert_empty, pool, raw, run_step

import daftrain  # noqa: F401  (registers the ops)
from daftrain.pool import AdaptiveGrowth, Demand, FixedGrowth, TrackingGrowth

# -- grow / shrink --------------------------------------------------------------------------------------------


def test_fixed_growth_grows_and_shrinks_in_steps():
    step = 16 * PS
    with pool(growth=FixedGrowth(step)) as p:
        run_step(p, [10 * PS] * 5)  # 50 pages -> 4 chunks of 16
        s = p.stats()
        assert s.reserved_bytes == 4 * step and s.grow_events == 4 and s.chunks == 4
        run_step(p, [10 * PS] * 2)  # peak 20 pages: keep 2 chunks
        s = p.stats()
        assert s.reserved_bytes == 2 * step and s.shrink_events == 2
        run_step(p, [10 * PS] * 2)
        assert p.stats().grow_events == 4 and p.stats().shrink_events == 2  # steady: nothing moves
        p.set_max_bytes(step)
        assert p.stats().reserved_bytes == step and p.stats().shrink_events == 3


def test_fixed_growth_is_capped_by_max_bytes():
    with pool(growth=FixedGrowth(100 * PS), max_bytes=30 * PS) as p:
        r = p.store(raw(PS, 0), 1.0)
        assert p.stats().reserved_bytes == 30 * PS
        r.release()


def test_adaptive_growth_follows_demand():
    policy = AdaptiveGrowth(min_step_bytes=4 * PS)

    def near(reserved: int, pages: int) -> bool:
        # at least the demand, at most one chunk (granule) plus the hysteresis slack above it
        return pages * PS <= reserved <= pages * PS * (1 + policy.granule + policy.slack) + PS

    with pool(growth=policy) as p:
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


def test_tracking_growth_covers_the_shortfall():
    policy = TrackingGrowth()
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


def test_tracking_growth_follows_each_step_peak():
    policy = TrackingGrowth(min_step_bytes=4 * PS)  # the granule is 4 pages at these sizes (mean / 32 < 4)
    granule = 4 * PS
    with pool(growth=policy) as p:
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
    from daftrain.rss import current_rss_bytes

    chunk = 64 << 20
    with pool(page_size=64 << 10, growth=FixedGrowth(chunk)) as p:
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


