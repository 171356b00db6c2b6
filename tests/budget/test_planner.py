"""The cost model and plan search on synthetic profiles (no model runs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from daftrain.budget.budgets import BudgetTooSmallError
from daftrain.budget.planner import PlannerConfig, Profile, SegmentProfile, plan_step
from daftrain.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError

MB = 10**6


def profile(batch: int = 64, n_seg: int = 4, per_seg: float = 4 * MB, fwd: float = 0.001) -> Profile:
    bits = (None, 8, 4, 2)
    ratio = {None: 1.0, 8: 0.27, 4: 0.15, 2: 0.08}
    segs = tuple(SegmentProfile(f"blocks.{i}", {b: per_seg * ratio[b] for b in bits}, 0.5 * MB, fwd)
                 for i in range(n_seg))
    return Profile(
        batch_size=batch, segments=segs, outside={b: 1 * MB * ratio[b] for b in bits},
        work_per_sample={b: 1 * MB for b in bits}, work_fixed=2 * MB,
        per_sample_s={None: 0.010, 8: 0.013, 4: 0.013, 2: 0.012}, fixed_s={b: 0.05 for b in bits},
        optimizer_transient=10 * MB,
    )


def act(p: Profile, plan) -> float:
    return plan.predicted_peak_bytes - plan.persistent_bytes


def test_ample_budget_runs_full_batch_exact():
    p = profile()
    plan = plan_step(p, budget_bytes=10_000 * MB, persistent_bytes=100 * MB, config=PlannerConfig())
    assert plan.num_micro_batches == 1 and plan.bits is None and plan.checkpointed == ()
    assert "Plan: batch 64" in str(plan) and "blocks.3" in str(plan)


@pytest.mark.parametrize("headroom_mb", [1200, 600, 300, 150, 60, 30])
def test_plan_fits_headroom_and_covers_batch(headroom_mb):
    p, cfg = profile(), PlannerConfig()
    plan = plan_step(p, budget_bytes=(100 + headroom_mb) * MB, persistent_bytes=100 * MB, config=cfg)
    assert plan.predicted_peak_bytes <= 100 * MB + cfg.safety * headroom_mb * MB
    assert plan.micro_batch_size * plan.num_micro_batches >= p.batch_size
    assert (plan.micro_batch_size - 1) * plan.num_micro_batches < p.batch_size  # balanced slices


def test_tighter_budget_never_gets_faster():
    p, times = profile(), []
    for headroom in (1200, 600, 300, 150, 60, 30):
        times.append(plan_step(p, budget_bytes=(100 + headroom) * MB, persistent_bytes=100 * MB,
                               config=PlannerConfig()).predicted_step_s)
    assert times == sorted(times)


def test_compression_or_checkpointing_used_when_tight():
    p = profile()
    exact_only = plan_step(p, budget_bytes=160 * MB, persistent_bytes=100 * MB,
                           config=PlannerConfig(bits=(None,), checkpoint=False))
    full = plan_step(p, budget_bytes=160 * MB, persistent_bytes=100 * MB, config=PlannerConfig())
    assert full.micro_batch_size > exact_only.micro_batch_size
    assert full.bits is not None or full.checkpointed
    assert full.predicted_step_s < exact_only.predicted_step_s


def test_prefers_exact_when_nearly_as_fast():
    p = profile()
    cfg = PlannerConfig(prefer_exact_within=0.5)
    plan = plan_step(p, budget_bytes=10_000 * MB, persistent_bytes=100 * MB, config=cfg)
    assert plan.bits is None


def test_too_small_budget_names_smallest_fitting_budget():
    p, cfg = profile(), PlannerConfig()
    with pytest.raises(BudgetTooSmallError) as info:
        plan_step(p, budget_bytes=105 * MB, persistent_bytes=100 * MB, config=cfg)
    required = info.value.required_bytes
    assert required > 105 * MB
    plan_step(p, budget_bytes=required, persistent_bytes=100 * MB, config=cfg)  # that budget fits
    with pytest.raises(BudgetTooSmallError):
        plan_step(p, budget_bytes=required - 2, persistent_bytes=100 * MB, config=cfg)


def test_alpha_makes_plans_more_conservative():
    p = profile()
    kw = dict(budget_bytes=400 * MB, persistent_bytes=100 * MB, config=PlannerConfig(bits=(None,), checkpoint=False))
    assert plan_step(p, alpha=2.0, **kw).micro_batch_size < plan_step(p, alpha=1.0, **kw).micro_batch_size


@pytest.mark.parametrize("kwargs", [
    {"bits": ()}, {"bits": (3,)}, {"bits": [2]}, {"safety": 0}, {"safety": 1.5}, {"prefer_exact_within": 1},
    {"max_alpha": 0.5}, {"compression_reserve": -1}, {"checkpoint": 1}, {"compressed_time_factor": 0.9},
])
def test_config_validation(kwargs):
    with pytest.raises((ValueError, TypeError)):
        PlannerConfig(**kwargs)


def test_required_budget_plans_across_profiles_and_margins():
    """``budget = err.required_bytes`` plans for any safety and alpha, and one byte less does not."""
    for safety in (0.9, 0.7, 0.33, 1.0):
        for alpha in (1.0, 1.37):
            for per_seg in (1 * MB, 3.3 * MB, 7.77 * MB):
                p, cfg = profile(per_seg=per_seg), PlannerConfig(safety=safety)
                with pytest.raises(BudgetTooSmallError) as info:
                    plan_step(p, budget_bytes=101 * MB, persistent_bytes=100 * MB + 7, config=cfg, alpha=alpha)
                required = info.value.required_bytes
                plan = plan_step(p, budget_bytes=required, persistent_bytes=100 * MB + 7, config=cfg, alpha=alpha)
                assert plan.predicted_peak_bytes <= 100 * MB + 7 + safety * (required - 100 * MB - 7)
                with pytest.raises(BudgetTooSmallError):
                    plan_step(p, budget_bytes=required - 1, persistent_bytes=100 * MB + 7, config=cfg, alpha=alpha)


def test_profile_of_an_empty_batch_is_refused():
    """A 0-sample batch used to end in a bare ZeroDivisionError."""

    with pytest.raises(InvalidArgumentError, match=r"batch_size is 0.*at least one sample"):
        plan_step(replace(profile(), batch_size=0), budget_bytes=10_000 * MB, persistent_bytes=100 * MB,
                  config=PlannerConfig())


def test_bits_without_measurements_name_the_config():
    """Only compressed bits allowed, but compression was never probed: no plan, and no OverflowError."""
    exact_only = profile()
    keep = (None,)
    exact_only = Profile(
        batch_size=exact_only.batch_size,
        segments=tuple(SegmentProfile(s.name, {None: s.saved[None]}, s.input_bytes, s.forward_s)
                       for s in exact_only.segments),
        outside={None: exact_only.outside[None]}, work_per_sample={None: 1 * MB}, work_fixed=2 * MB,
        per_sample_s={b: exact_only.per_sample_s[b] for b in keep}, fixed_s={None: 0.05},
        optimizer_transient=10 * MB,
    )
    with pytest.raises(UnsupportedError, match=r"PlannerConfig.bits allows \(2,\).*only for exact.*allow None"):
        plan_step(exact_only, budget_bytes=105 * MB, persistent_bytes=100 * MB, config=PlannerConfig(bits=(2,)))


@pytest.mark.parametrize("kwargs", [{"safety": "0.9"}, {"prefer_exact_within": None}, {"max_alpha": "4"}])
def test_config_type_errors_are_daftrain_errors(kwargs):
    """A string where a number belongs used to raise a bare TypeError from the comparison."""
    with pytest.raises(ArgumentTypeError, match=f"PlannerConfig.{next(iter(kwargs))} must be a number"):
        PlannerConfig(**kwargs)


def test_trims_are_weighed_against_smaller_micro_batches():
    """NOTE [ The cost model ], 3.: a plan whose two micro-batches fit the headroom never trims and is
    modelled at twice its activations; a larger one pays its trims. Cheap micro-batches and dear trims
    take the former, free trims the largest micro-batch that fits."""
    kw = dict(budget_bytes=200 * MB, persistent_bytes=100 * MB, config=PlannerConfig(bits=(None,), checkpoint=False))
    free = plan_step(profile(), **kw)
    assert free.num_micro_batches > 1
    assert act(None, free) == pytest.approx(free.predicted_activation_bytes)
    assert 2 * free.predicted_activation_bytes > 0.9 * 100 * MB  # it trims
    dear = replace(profile(), refault_s_per_byte=1e-9, fixed_s={b: 0.001 for b in (None, 8, 4, 2)})
    lean = plan_step(dear, **kw)
    assert lean.micro_batch_size < free.micro_batch_size
    # twice the activations of one micro-batch fit the headroom, and are what the plan predicts
    headroom = 0.9 * 100 * MB
    one = dear.work_fixed + (dear.outside[None] + dear.work_per_sample[None] +
                             sum(s.saved[None] for s in dear.segments)) * lean.micro_batch_size
    assert 2 * one <= headroom
    assert lean.predicted_activation_bytes == pytest.approx(2 * one, abs=1)
    largest = plan_step(replace(dear, refault_s_per_byte=0.0), **kw)
    assert largest.micro_batch_size == free.micro_batch_size
    trims = (2 * largest.num_micro_batches - 1) * 1e-9 * largest.predicted_activation_bytes
    assert lean.predicted_step_s < largest.predicted_step_s + trims
    # where micro-batches are dear the trims are worth it again
    costly_batches = replace(dear, fixed_s={b: 10.0 for b in (None, 8, 4, 2)})
    assert plan_step(costly_batches, **kw).micro_batch_size == free.micro_batch_size


@pytest.mark.parametrize("kept", [0.25, 0.6])
def test_a_measured_kept_share_lets_larger_micro_batches_run_without_trims(kept):
    """NOTE [ The cost model ], 3.: where the allocator was measured to keep only a share of a micro-batch's
    activations beside the next, the plan that never trims takes larger micro-batches, and predicts that
    share beside its own."""
    kw = dict(budget_bytes=200 * MB, persistent_bytes=100 * MB, config=PlannerConfig(bits=(None,), checkpoint=False))
    dear = replace(profile(), refault_s_per_byte=1e-9, fixed_s={b: 0.001 for b in (None, 8, 4, 2)})
    whole = plan_step(dear, **kw)
    measured = plan_step(replace(dear, freed_kept=kept), **kw)
    assert measured.micro_batch_size > whole.micro_batch_size
    one = dear.work_fixed + (dear.outside[None] + dear.work_per_sample[None] +
                             sum(s.saved[None] for s in dear.segments)) * measured.micro_batch_size
    assert (1 + kept) * one <= 0.9 * 100 * MB
    assert measured.predicted_activation_bytes == pytest.approx((1 + kept) * one, abs=1)


def test_time_scale_corrects_the_choice_between_bit_widths():
    """NOTE [ The cost model ], 4.: the measured time of each lever decides once it is known."""
    p = profile()
    kw = dict(budget_bytes=160 * MB, persistent_bytes=100 * MB, config=PlannerConfig(checkpoint=False))
    compressed = plan_step(p, **kw)
    assert compressed.bits is not None
    slow = plan_step(p, time_scale={(compressed.bits, False): 10.0}, **kw)
    assert slow.bits != compressed.bits
    assert slow.predicted_step_s <= 10.0 * compressed.predicted_step_s


def test_checkpointed_segments_recompute_at_the_plans_bits():
    """NOTE [ The cost model ], 1. and 2.: a compressed plan's recomputation is stored at its bits
    (``daftrain.checkpoint``), and costs one more forward of each checkpointed segment."""
    p = profile(per_seg=40 * MB)
    plan = plan_step(p, budget_bytes=130 * MB, persistent_bytes=100 * MB, config=PlannerConfig(bits=(2,)))
    assert plan.bits == 2 and plan.checkpointed
    ckpt = set(plan.checkpointed)
    per_sample = (p.outside[2] + p.work_per_sample[2]
                  + sum(s.input_bytes if s.name in ckpt else s.saved[2] for s in p.segments)
                  + max(s.saved[2] for s in p.segments if s.name in ckpt))
    one = p.work_fixed + per_sample * plan.micro_batch_size
    assert plan.predicted_activation_bytes in (pytest.approx(one), pytest.approx(2 * one))
    forward = sum(s.forward_s for s in p.segments if s.name in ckpt)
    step_s = plan.num_micro_batches * p.fixed_s[2] + p.batch_size * (p.per_sample_s[2] + forward)
    assert plan.predicted_step_s == pytest.approx(step_s)


def test_within_the_margin_fewer_checkpointed_segments_win():
    """``prefer_exact_within``: a checkpointed plan measured a little faster (a noisy time correction) does not
    displace the plan that recomputes nothing."""
    p = replace(profile(), segments=tuple(replace(s, forward_s=0.0) for s in profile().segments))
    kw = dict(budget_bytes=4000 * MB, persistent_bytes=100 * MB, config=PlannerConfig(bits=(None,)))
    plain = plan_step(p, **kw)
    assert plain.checkpointed == () and plain.num_micro_batches == 1  # everything fits: nothing to save
    noisy = {(None, False): 1.0, (None, True): 0.97}  # the recomputing lever measured 3 % fast
    assert plan_step(p, time_scale=noisy, **kw).checkpointed == ()
    clearly = {(None, False): 1.0, (None, True): 0.5}  # far faster: the measurement decides
    assert plan_step(p, time_scale=clearly, **kw).checkpointed != ()
