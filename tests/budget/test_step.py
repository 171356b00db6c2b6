"""BudgetedStep on tiny models: gradient equivalence of micro-batching, measured peaks under budget,
re-planning when the budget changes, and clear errors."""

from __future__ import annotations

import copy
import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import daftrain.budget.step as step_module
from daftrain.allocator import glibc as allocator_glibc
from daftrain.budget.batching import balanced_sizes, shapes_of, token_count
from daftrain.budget.budgets import BudgetTooSmallError
from daftrain.budget.planner import PlannerConfig, plan_step
from daftrain.budget.segments import batchnorm_to_groupnorm
from daftrain.budget.step import BudgetedStep
from daftrain.budget.weight_grads import weight_grads_in_place
from daftrain.config import CompressionConfig
from daftrain.errors import ArgumentTypeError, InvalidArgumentError
from daftrain.pool import PagePool, PoolConfig
from daftrain.rss import current_rss_bytes, reset_peak_rss


@pytest.fixture(autouse=True)
def trimmed_heap() -> None:
    """Start every test from a trimmed heap, as ``BudgetedStep``'s meter starts every phase
    (``reset_peak_rss``): otherwise memory an earlier test freed into glibc's arenas is in the RSS these
    tests read but not in the baseline the step measures, and the two disagree by that much."""
    reset_peak_rss()


def mlp(width: int = 64, depth: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
                         nn.Linear(width, 10))


def ce(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def forced_plan(step: BudgetedStep, batch, micro: int, ckpt: bool, bits=None) -> None:
    """Run one step of ``step`` with a fixed plan (micro-batch size, all segments checkpointed or none)."""
    from daftrain.budget.planner import Plan

    B = batch[0].shape[0]
    k = -(-B // micro)
    plan = Plan(budget_bytes=0, persistent_bytes=0, batch_size=B, micro_batch_size=-(-B // k), num_micro_batches=k,
                checkpointed=tuple(step.segments) if ckpt else (), bits=bits, predicted_peak_bytes=0,
                predicted_step_s=0.0, alpha=1.0)
    return step._accumulate(batch, plan, k, float(step.count(batch)))[0]


@pytest.mark.parametrize(("micro", "ckpt"), [(7, False), (4, True), (1, False), (32, True)])
def test_micro_batching_matches_full_batch_gradient(micro, ckpt):
    torch.manual_seed(1)
    x, y = torch.randn(32, 64, dtype=torch.float64), torch.randint(0, 10, (32,))
    ref = mlp().double()
    F.cross_entropy(ref(x), y).backward()
    model = mlp().double()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB", tune_allocator=False)
    loss = forced_plan(step, (x, y), micro, ckpt)
    assert loss == pytest.approx(F.cross_entropy(ref(x), y).item(), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("over_head", [True, False])
def test_exact_plans_run_the_loss_over_a_wide_head(over_head, monkeypatch):
    """NOTE [ Exact training with the loss over the head ]: an exact plan (and the planning step's exact slices) runs a
    language model's cross-entropy over its head unless the compression config turns that off; the gradients are
    the full batch's to float rounding either way."""
    from daftrain.saved import linear_cross_entropy

    calls = []
    forward = linear_cross_entropy._OverLinear.forward
    monkeypatch.setattr(linear_cross_entropy._OverLinear, "forward",
                        staticmethod(lambda ctx, *args: calls.append(1) or forward(ctx, *args)))
    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
            self.head = nn.Linear(16, 1000)  # 1000 logits from 16 features: a wide head

        def forward(self, ids):
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    torch.manual_seed(4)
    ref = TinyLM()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 1000, (8, 12))

    def lm_loss(m, b):
        return F.cross_entropy(m(b[0]).view(-1, 1000), b[0].view(-1))

    lm_loss(ref, (ids,)).backward()
    step = BudgetedStep(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        tune_allocator=False, config=PlannerConfig(bits=(None,)),
                        compression=CompressionConfig(linear_cross_entropy=over_head))
    forced_plan(step, (ids,), 3, ckpt=True)
    assert len(calls) == (3 if over_head else 0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # float32, summed in another order
    model.zero_grad(set_to_none=True)
    step((ids,))  # the planning step's slices and the plan's micro-batches
    assert step.plan.bits is None and (len(calls) > 3) == over_head


def test_token_mean_loss_weighted_by_tokens():
    """Per-token mean with ignored labels: micro-batches weighted by their counted tokens."""
    torch.manual_seed(2)
    emb = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)).double()
    ids = torch.randint(0, 50, (6, 9))
    labels = ids.clone()
    labels[0, 3:] = -100  # uneven numbers of counted tokens per sequence
    labels[4, 1:7] = -100

    def lm_loss(model, b):
        logits = model(b["input_ids"])[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 50), b["labels"][:, 1:].reshape(-1), ignore_index=-100)

    ref = copy.deepcopy(emb)
    lm_loss(ref, {"input_ids": ids, "labels": labels}).backward()
    step = BudgetedStep(emb, lm_loss, torch.optim.SGD(emb.parameters(), lr=0.1), budget="100GB",
                        count=token_count("labels"), tune_allocator=False)
    from daftrain.budget.planner import Plan

    plan = Plan(0, 0, 6, 2, 3, (), None, 0, 0.0, 1.0)
    batch = {"input_ids": ids, "labels": labels}
    step._accumulate(batch, plan, plan.num_micro_batches, float(step.count(batch)))
    for p, q in zip(emb.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


class _Wrapped(nn.Module):
    """A model class of the user's around ``inner``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_compiled_model_trains_as_plain_and_is_warned_about(how):
    # NOTE [ Planning a compiled model ]: the measuring hooks, traced into the compiled graph, failed on the
    # slices' symbolic sizes (a Dynamo error); they run eagerly now, and the step warns of what it measures.
    torch.manual_seed(2)
    batch = (torch.randn(96, 64), torch.randint(0, 10, (96,)))
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        ce(ref, batch).backward()
        opt.step()
    torch._dynamo.reset()
    model, counter = _Wrapped(mlp()), CompileCounterWithBackend("aot_eager")
    if how == "torch.compile":
        compiled = torch.compile(model, backend=counter)
    else:  # in place: compiles a model class of the user's (torch.nn's containers are not compiled so)
        compiled = model
        model.compile(backend=counter)
    with pytest.warns(UserWarning, match="compiled with torch.compile"):
        step = BudgetedStep(compiled, ce, torch.optim.SGD(model.parameters(), lr=0.5), budget="100GB",
                            config=PlannerConfig(bits=(None,)), tune_allocator=False)
    for _ in range(2):
        step(batch)
    assert step.history[0].planning and len(step.history) == 2 and counter.frame_count >= 1
    for p, q in zip(model.inner.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # float32: summation order over the slices


def _lm_batch(ignored: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50, (6, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    if ignored:
        labels[0, 3:] = -100
    return {"input_ids": ids, "labels": labels}


def _lm_loss(model: nn.Module, b) -> torch.Tensor:
    logits = model(b["input_ids"])[:, :-1]
    return F.cross_entropy(logits.reshape(-1, 50), b["labels"][:, 1:].reshape(-1), ignore_index=-100)


@pytest.mark.parametrize(("ignored", "count", "warns"), [
    (True, None, True), (True, token_count(), False), (False, None, False),
], ids=["ignored-labels", "token-count", "no-ignored-labels"])
def test_a_per_token_loss_counted_by_samples_warns_once(ignored, count, warns, recwarn):
    # NOTE [ Micro-batching keeps the math ]: counting samples where the loss averages tokens is the
    # gradient-accumulation bug users of Hugging Face's Trainer met.
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
    step = BudgetedStep(model, _lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        config=PlannerConfig(bits=(None,)), count=count, tune_allocator=False)
    for _ in range(2):
        step(_lm_batch(ignored))
    named = [w for w in recwarn.list if "count=daftrain.token_count()" in str(w.message)]
    assert len(named) == (1 if warns else 0), [str(w.message) for w in recwarn.list]
    if warns:
        assert named[0].filename == __file__  # it points at the user's call


def test_full_step_trains_like_plain_sgd(device):
    """A budgeted step (planned, micro-batched) then optimizer.step equals plain full-batch SGD."""
    torch.manual_seed(3)
    x, y = torch.randn(64, 64, dtype=torch.float64).to(device), torch.randint(0, 10, (64,)).to(device)
    ref, model = mlp().double().to(device), mlp().double().to(device)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    opt_ref.step()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        config=PlannerConfig(bits=(None,)))
    step((x, y))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        assert p.grad is None


# -- memory, measured ------------------------------------------------------------------------------------

def big_case(seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)], nn.Linear(512, 10))
    x, y = torch.randn(4096, 512), torch.randint(0, 10, (4096,))  # ~8 MB per activation, ~130 MB saved
    return model.to(device), (x.to(device), y.to(device))


def held_now(device: str) -> int:
    """What a budget on ``device`` counts as held now: the RSS on CPU; on CUDA the memory the caching
    allocator reserves, once its free blocks are released (as the step's meter releases them)."""
    if device == "cpu":
        return current_rss_bytes()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def state_bytes(model: nn.Module) -> int:
    return 3 * sum(p.nbytes for p in model.parameters())  # gradients + Adam's two states


@pytest.mark.parametrize("headroom_mb", [30, 60])
def test_measured_peak_stays_under_budget(headroom_mb, device):
    model, batch = big_case(device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    budget = held_now(device) + state_bytes(model) + headroom_mb * 10**6
    step = BudgetedStep(model, ce, opt, budget=budget, config=PlannerConfig(bits=(None,)), tune_allocator=False)
    for _ in range(3):
        step(batch)
    assert step.plan.num_micro_batches > 1  # the plain step (~150 MB of activations) would not fit
    for rec in step.history:
        assert rec.peak_bytes <= budget, (rec.peak_bytes, budget, str(rec.plan))
    assert step.process_peak_bytes <= budget


def test_budget_change_replans_and_fits(device):
    model, batch = big_case(1, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    base = held_now(device) + state_bytes(model)
    limit = {"now": base + 80 * 10**6}
    step = BudgetedStep(model, ce, opt, budget=lambda: limit["now"], config=PlannerConfig(bits=(None,)),
                        tune_allocator=False)
    step(batch)
    step(batch)
    wide = step.plan.micro_batch_size
    limit["now"] = base + 30 * 10**6
    step(batch)
    assert step.history[-1].replanned and step.plan.micro_batch_size < wide
    limit["now"] = base + 80 * 10**6
    step(batch)
    assert step.plan.micro_batch_size > step.history[-2].plan.micro_batch_size
    for rec in step.history:
        assert rec.peak_bytes <= rec.budget_bytes, (rec.peak_bytes, rec.budget_bytes)


class KeepsPerShape(nn.Module):
    """Holds ``nbytes`` for good for every input shape it runs, as backends keep state per shape
    (oneDNN's primitive cache, cuDNN's plans)."""

    def __init__(self, inner: nn.Module, nbytes: int) -> None:
        super().__init__()
        self.inner, self.nbytes, self.kept = inner, nbytes, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape) not in self.kept:
            self.kept[tuple(x.shape)] = torch.ones(self.nbytes // 4)  # written: resident
        return self.inner(x)


def test_memory_kept_per_input_shape_is_measured():
    model, batch = big_case(3)
    per_shape = 6 * 10**6
    kept = KeepsPerShape(model, per_shape)
    opt = torch.optim.Adam(kept.parameters(), lr=1e-3)
    budget = current_rss_bytes() + state_bytes(model) + 200 * 10**6
    step = BudgetedStep(kept, ce, opt, budget=budget, config=PlannerConfig(bits=(None,)))

    def close(measured: float) -> bool:  # the buffer, and at most the allocator's noise beside it
        return 0.9 * per_shape <= measured <= per_shape + 3 * 10**6

    step(batch)  # the planning step's slices: each of a new shape
    assert len(step._held_per_shape) >= 2 and all(map(close, step._held_per_shape)), step._held_per_shape
    step(batch)
    kept.kept.clear()
    step._shapes.clear()  # the next step's shapes are new again, to the model and to the step
    step._new_shapes_since = None  # what the cache held before it was emptied by hand is not measured
    step(batch)
    step(batch)  # measures what the step before left held, at its start
    assert close(step._held_per_shape[-1]), step._held_per_shape
    step._shapes |= {shapes_of(batch, n) for n in range(1, 4097)}  # whatever the next plans, no shape is new
    step(batch)
    assert step._new_shapes_since is None
    measured = list(step._held_per_shape)
    step(batch)  # nothing to measure
    assert list(step._held_per_shape) == measured
    for rec in step.history:
        assert rec.peak_bytes <= rec.budget_bytes, (rec.peak_bytes, rec.budget_bytes, str(rec.plan))


def test_the_share_the_allocator_keeps_is_measured_from_steps_that_did_not_trim():
    model, batch = big_case(5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    budget = current_rss_bytes() + state_bytes(model) + 120 * 10**6
    step = BudgetedStep(model, ce, opt, budget=budget, config=PlannerConfig(bits=(None,)))
    step._prober.refault_s_per_byte = 1e-6  # trims priced dear: the plans never trim, whatever the timings
    for _ in range(5):
        step(batch)
    assert step._kept, "no plan kept one micro-batch's freed memory beside the next"
    assert all(0.0 <= k <= 1.0 for k in step._kept) and step.profile.freed_kept == max(step._kept)
    for rec in step.history:
        assert rec.peak_bytes <= rec.budget_bytes, (rec.peak_bytes, rec.budget_bytes, str(rec.plan))
    # a plan that had to trim is no measurement of what the allocator keeps: it counts as all of it
    step._kept.clear()
    step._correct_kept(1.0)
    assert step.profile.freed_kept == 1.0
    untrimmed = step._accumulate(batch, step.plan, 4, 4096.0, ceiling=100.0)[2]
    assert untrimmed == 0  # a ceiling of 100 bytes trims before every micro-batch


def test_plan_reserves_room_for_the_shapes_it_brings():
    model, batch = big_case(4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = BudgetedStep(model, ce, opt, budget=current_rss_bytes() + state_bytes(model) + 60 * 10**6,
                        config=PlannerConfig(bits=(None,)), tune_allocator=False)
    step(batch)
    budget, held = step.budget.bytes(), step.plan.persistent_bytes
    unreserved = plan_step(step.profile, budget_bytes=budget, persistent_bytes=held, config=step.config,
                           alpha=step.alpha, time_scale=step._time_scale())
    step._held_per_shape.extend([5e6] * 3)
    step._shapes.clear()  # every plan's micro-batches are new shapes
    new, reserve = step._plan(batch, None, budget, held)
    assert reserve >= math.ceil(5e6 * len(set(balanced_sizes(4096, new.num_micro_batches)))) > 0
    assert new.persistent_bytes == held + reserve
    assert new.micro_batch_size <= unreserved.micro_batch_size
    step._shapes |= {shapes_of(batch, n) for n in range(1, 4097)}  # every size run before
    known, reserve = step._plan(batch, None, budget, held)
    assert reserve == 0 and known == unreserved


def test_a_budget_the_compression_kernels_took_is_named_in_the_error(monkeypatch):
    torch.manual_seed(0)
    model = mlp()
    batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    pulls = []
    monkeypatch.setattr(step_module, "tighten_allocator", lambda: pulls.append(1) is None)
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        config=PlannerConfig(bits=(2,), compression_reserve=0, checkpoint=False))

    def no_plan(*args, **kwargs):
        raise BudgetTooSmallError(10**9, 2 * 10**9)

    monkeypatch.setattr(step_module, "plan_step", no_plan)
    with pytest.raises(BudgetTooSmallError, match="loaded the compression kernels") as info, \
            pytest.warns(UserWarning, match="no plan fits the budget while glibc keeps freed memory"):
        step(batch)  # the planning step measures 2-bit slices: the kernels are loaded, for good
    assert isinstance(info.value.__cause__, BudgetTooSmallError) and info.value.required_bytes == 2 * 10**9
    assert pulls == [1]  # tried again with the allocator's lever (NOTE [ The allocator as a lever ]), once
    with pytest.raises(BudgetTooSmallError) as info:
        step(batch)  # loaded before this step: nothing to add
    assert "compression kernels" not in str(info.value)


@pytest.mark.parametrize("tune_allocator", [None, False])
def test_no_plan_fitting_pulls_the_allocator_lever_and_plans_again(tune_allocator, monkeypatch):
    """NOTE [ The allocator as a lever ]: where no plan fits with glibc's own threshold, the default fixes it and
    measures again (here the first plan fails, the second fits); ``tune_allocator=False`` raises."""
    pulls, plans = [], []
    monkeypatch.setattr(step_module, "tighten_allocator", lambda: pulls.append(1) is None)
    plan_step_ = step_module.plan_step

    def first_fails(*args, **kwargs):
        plans.append(1)
        if len(plans) == 1:
            raise BudgetTooSmallError(10**9, 2 * 10**9)
        return plan_step_(*args, **kwargs)

    monkeypatch.setattr(step_module, "plan_step", first_fails)
    torch.manual_seed(0)
    model = mlp()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        config=PlannerConfig(bits=(None,)), tune_allocator=tune_allocator)
    batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    if tune_allocator is False:
        with pytest.raises(BudgetTooSmallError):
            step(batch)
        assert pulls == [] and not step.history
        return
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="no plan fits the budget while glibc keeps freed memory"):
        step(batch)
    took = time.perf_counter() - start
    assert pulls == [1] and len(plans) == 2 and len(step.history) == 1 and step.history[0].allocator_tightened
    assert step.history[0].step_s > 0.9 * took  # the first try's planning counted in the step's time


def test_too_small_budget_raises_naming_the_floor():
    model, batch = big_case(2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rss = current_rss_bytes()
    step = BudgetedStep(model, ce, opt, budget=rss - 10**6, tune_allocator=False)
    with pytest.raises(BudgetTooSmallError) as info:
        step(batch)
    assert info.value.required_bytes > rss
    limit = {"now": "100GB"}
    step = BudgetedStep(model, ce, opt, budget=lambda: limit["now"], config=PlannerConfig(bits=(None,)),
                        tune_allocator=False)
    step(batch)
    reset_peak_rss()  # what the process holds once freed memory is returned, as the step reads it
    held = current_rss_bytes()
    limit["now"] = held + 1000  # below what any plan needs
    with pytest.raises(BudgetTooSmallError) as info:
        step(batch)
    floor = info.value.required_bytes
    assert floor > held + 1000 and "Raise the budget to at least" in str(info.value)
    # the named floor is a budget the planner accepts
    plan_step(step.profile, budget_bytes=floor + 10**6, persistent_bytes=current_rss_bytes(),
              config=step.config, alpha=step.alpha)


def recorded_lever(monkeypatch) -> list[int]:
    """Replace the allocator lever by a recorder, so that the test process keeps glibc's defaults."""
    pulls: list[int] = []
    monkeypatch.setattr(step_module, "tighten_allocator", lambda: pulls.append(1) is None)
    return pulls


def test_the_default_fixes_the_allocator_only_where_the_room_is_tight(monkeypatch):
    """NOTE [ The allocator as a lever ]: a room below ``tighten_below`` pulls the lever once, before the
    planning step, with a warning; a wide room never; ``False`` never; ``True`` at construction."""
    pulls = recorded_lever(monkeypatch)
    torch.manual_seed(0)
    batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))

    def make(**kwargs) -> BudgetedStep:
        model = mlp()
        return BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB", **kwargs)

    roomy = make(config=PlannerConfig(bits=(None,)))
    roomy(batch)
    roomy(batch)
    assert pulls == [] and not roomy.allocator_tightened
    assert not any(rec.allocator_tightened for rec in roomy.history)
    tight = PlannerConfig(bits=(None,), tighten_below=10**12)  # 100 GB leaves less room than that
    never = make(config=tight, tune_allocator=False)
    never(batch)
    assert pulls == [] and not never.history[-1].allocator_tightened
    step = make(config=tight)
    with pytest.warns(UserWarning, match=r"less than PlannerConfig.tighten_below.*tune_allocator=False"):
        step(batch)
    assert pulls == [1] and step.allocator_tightened and step.history[0].allocator_tightened
    step(batch)  # once for the process's lifetime of this step
    assert pulls == [1] and step.history[1].allocator_tightened
    make(tune_allocator=True)
    assert pulls == [1, 1]
    with pytest.raises(ArgumentTypeError, match="tune_allocator must be None"):
        make(tune_allocator="yes")
    with pytest.raises(InvalidArgumentError, match="tighten_below"):
        PlannerConfig(tighten_below=-1)


def test_a_step_over_its_budget_fixes_the_allocator_for_the_next(monkeypatch):
    pulls = recorded_lever(monkeypatch)
    torch.manual_seed(0)
    model = mlp()
    batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        config=PlannerConfig(bits=(None,)))
    step(batch)
    assert pulls == []
    monkeypatch.setattr(step._meter, "peak", lambda: 10**12)  # the step measures a peak above 100 GB
    with pytest.warns(UserWarning, match=r"step 1 peaked .* MB over the budget"):
        step(batch)
    assert pulls == [1] and step.history[1].allocator_tightened and not step.history[0].allocator_tightened


def test_the_lever_fixes_glibcs_threshold_in_a_fresh_process():
    """The default lever, pulled for real: afterwards a freed 1 MiB block leaves the process at once
    (its own mapping), where glibc's dynamic threshold, raised by a freed 16 MiB block, kept it."""
    import subprocess
    import sys

    if allocator_glibc() is None or not hasattr(allocator_glibc(), "mallopt"):
        pytest.skip("no glibc on this system: the lever is a no-op there")
    code = """
import sys, warnings, torch, torch.nn.functional as F
from torch import nn
from daftrain import BudgetedStep, PlannerConfig
from daftrain.allocator import glibc
from daftrain.rss import current_rss_bytes
big = torch.ones(16 << 20, dtype=torch.uint8)
del big  # glibc's dynamic threshold rises to 16 MiB: 1 MiB blocks come from the heap from now on
model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
step = BudgetedStep(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), torch.optim.SGD(model.parameters(), 0.1),
                    budget="100GB", config=PlannerConfig(bits=(None,), tighten_below=int(sys.argv[1])))
with warnings.catch_warnings(record=True):
    step((torch.randn(32, 64), torch.randint(0, 10, (32,))))
glibc().mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: glibc trims the heap's top no more
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(48)]
with_blocks = current_rss_bytes()
del blocks
print(int(step.allocator_tightened), with_blocks - current_rss_bytes())
"""
    result = {}
    for below in ("1000000000000", "0"):  # 100 GB of room is below the first, never below 0
        out = subprocess.run([sys.executable, "-c", code, below], capture_output=True, text=True, check=True)
        tightened, released = out.stdout.split()
        result[below] = (int(tightened), int(released))
    assert result["1000000000000"][0] == 1 and result["1000000000000"][1] > 40 << 20, result
    assert result["0"][0] == 0 and result["0"][1] < 8 << 20, result


@pytest.mark.parametrize("auto", [False, True])
def test_compressed_plan_runs(auto):
    model, batch = big_case(3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    base = current_rss_bytes() + sum(p.nbytes for p in model.parameters())
    step = BudgetedStep(model, ce, opt, budget=base + 400 * 10**6,
                        config=PlannerConfig(bits=(2,), compression_reserve=0, checkpoint=False),
                        compression=CompressionConfig(bits="auto") if auto else None)
    loss = step(batch)
    assert step.plan.bits == 2 and torch.isfinite(torch.tensor(loss))
    assert all(ctx.config.auto == auto for ctx in step._contexts.values())
    assert set(step.profile.bits_options) == {None, 2}
    assert step.profile.outside[2] + sum(s.saved[2] for s in step.profile.segments) < \
        0.5 * (step.profile.outside[None] + sum(s.saved[None] for s in step.profile.segments))


class Scaled(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def layered(seed: int = 0) -> nn.Module:
    """Layers of different widths, the first two blocks' output scaled down (as a residual branch's scale or
    a gate can be): their saved tensors carry very different shares of the gradient, a trade that
    ``bits="auto"`` takes clearly (``NOTE [ Uniform unless clearly better ]``)."""
    torch.manual_seed(seed)
    sizes = [256, 256, 512, 128, 512, 256]
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in itertools.pairwise(sizes)]
    blocks.insert(2, Scaled(0.1))
    return nn.Sequential(*blocks, nn.Linear(sizes[-1], 10))


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_bits_by_importance_store_the_plans_bytes_with_a_closer_gradient():
    """NOTE [ Bits by importance under a plan ]: at a plan's 2 bits, ``bits="auto"`` stores what fixed 2-bit
    stores and its gradient is closer to the exact one; one context serves both micro-batch sizes, adapting once."""
    torch.manual_seed(1)
    batch = (torch.randn(99, 256), torch.randint(0, 10, (99,)))  # 5 micro-batches: 20, 20, 20, 20, 19 samples
    ref = layered()
    ce(ref, batch).backward()
    exact = flat_grad(ref)
    error, stored = {}, {}
    for auto in (False, True):
        model = layered()
        step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                            compression=CompressionConfig(bits="auto") if auto else None)
        errors = []
        for _ in range(4):  # the first step adapts; the others run the allocation
            model.zero_grad(set_to_none=True)
            forced_plan(step, batch, 20, ckpt=False, bits=2)
            errors.append(float((flat_grad(model) - exact).norm() / exact.norm()))
        error[auto] = sum(errors[1:]) / 3
        stored[auto] = {key: ctx.stats.stored_bytes for key, ctx in step._contexts.items()}
        if auto:
            reports = {key: ctx.report() for key, ctx in step._contexts.items()}
            assert set(reports) == {2} and None not in reports.values()
            model.zero_grad(set_to_none=True)
            forced_plan(step, batch, 20, ckpt=False, bits=2)
            assert all(ctx.report() is reports[key] for key, ctx in step._contexts.items())  # no re-estimate
    # ``stats`` describe a context's latest forward: the 19-sample micro-batch for both
    assert stored[True][2] <= stored[False][2]
    # the relative error's spread across steps is about 1 % of it: 5 % lower is outside that
    assert error[True] < 0.95 * error[False], error


def test_bits_by_importance_recompute_at_the_plans_bits():
    model = layered()
    batch = (torch.randn(32, 256), torch.randint(0, 10, (32,)))
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        compression=CompressionConfig(bits="auto"))
    forced_plan(step, batch, 16, ckpt=True, bits=4)
    (ctx,) = step._contexts.values()
    recompute = ctx.recomputation_context()
    assert recompute.config.bits == 4 and recompute.stats.compressed > 0


def test_the_pool_holds_a_compressed_plans_records_under_the_plans_cap():
    """NOTE [ The pool under the plan's cap ]: records in the pool's pages, a cap from the plan that the
    model's own estimate meets (no eviction), every chunk freed after the micro-batches."""
    model, batch = big_case(4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    pool = PagePool(PoolConfig(page_size=4096))
    caps = []
    set_max_bytes = pool.set_max_bytes
    pool.set_max_bytes = lambda n: (caps.append(n), set_max_bytes(n))[1]
    limit = {"now": "100GB"}
    step = BudgetedStep(model, ce, opt, budget=lambda: limit["now"], pool=pool,
                        config=PlannerConfig(bits=(2,), compression_reserve=0, checkpoint=False))
    step(batch)
    whole = step.plan.predicted_activation_bytes  # one micro-batch of the whole batch
    reset_peak_rss()
    limit["now"] = current_rss_bytes() + sum(p.nbytes for p in model.parameters()) + int(0.7 * whole)
    for _ in range(3):
        step(batch)
    assert all(r.plan.bits == 2 for r in step.history) and step.plan.num_micro_batches > 1
    stats = pool.stats()
    assert stats.peak_used_bytes > 0 and stats.evictions == 0
    assert all(r.pool_evictions == 0 for r in step.history)
    assert stats.reserved_bytes == 0 and stats.max_bytes == pool.page_size  # released after the micro-batches
    room = [c for c in caps if c > pool.page_size]
    assert room and stats.peak_used_bytes <= min(room)
    for rec in step.history:
        assert rec.peak_bytes <= rec.budget_bytes, (rec.peak_bytes, rec.budget_bytes)
    step.close()
    pool.close()


def test_the_pool_evicts_where_the_plan_underestimates_its_records():
    """Records beyond the room the plan left are demoted, then spilled, and counted; the gradient stays a
    gradient."""
    torch.manual_seed(5)
    model, batch = big_case(5)
    batch = (batch[0][:512], batch[1][:512])
    ref = copy.deepcopy(model)
    ce(ref, batch).backward()
    pool = PagePool(PoolConfig(page_size=4096))
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=1e-3), budget="100GB", pool=pool,
                        config=PlannerConfig(bits=(2,), compression_reserve=0, checkpoint=False))
    step(batch)  # the profile
    from daftrain.budget.planner import Plan

    records = step.profile.outside[2] + sum(s.saved[2] for s in step.profile.segments)
    micro, room = 256, 300_000  # two micro-batches; the room holds about a quarter of one's records
    assert records * micro > 3 * room
    plan = Plan(0, 0, 512, micro, 2, (), 2, 0, 0.0, 1.0, predicted_activation_bytes=int(step.alpha * micro * records))
    model.zero_grad(set_to_none=True)
    before = step._cap_pool(plan, micro, budget=10**9 + room, persistent=10**9)
    assert pool.stats().max_bytes == room
    step._accumulate(batch, plan, 2, 512.0)
    assert pool.stats().peak_used_bytes <= room
    evicted = step._release_pool(plan, before)
    assert evicted > 0 and pool.stats().demotions > 0
    cos = F.cosine_similarity(flat_grad(model), flat_grad(ref), dim=0)
    # spilled records are lossless and the demoted ones unbiased at 1 bit: a noisier gradient, not a wrong one
    assert cos > 0.9, cos
    step.close()
    pool.close()


def test_batchnorm_warning_and_groupnorm_remedy():
    from daftrain.demo.models.resnet import resnet18

    model = resnet18(width=4)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.0), budget="100GB",
                        tune_allocator=False)
    from daftrain.budget.planner import Plan

    with pytest.warns(UserWarning, match="BatchNorm"):
        step._warn_batchnorm(Plan(0, 0, 16, 4, 4, (), None, 0, 0.0, 1.0))  # warns once for k > 1
    gn = batchnorm_to_groupnorm(resnet18(width=4), num_groups=2)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    ref = copy.deepcopy(gn).double()
    gn = gn.double()
    F.cross_entropy(ref(x.double()), y).backward()
    step = BudgetedStep(gn, ce, torch.optim.SGD(gn.parameters(), lr=0.0), budget="100GB", tune_allocator=False)
    step._accumulate((x.double(), y), Plan(0, 0, 16, 4, 4, ("layer1.0", "layer3.1"), None, 0, 0.0, 1.0), 4, 16.0)
    for p, q in zip(gn.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-11)


def test_inplace_refused_where_autograd_needs_the_input():
    class NeedsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            h = torch.sigmoid(self.lin(x))  # sigmoid saves its output h ...
            return self.act(h)              # ... which an in-place ReLU would overwrite

    model = NeedsInput().double()
    ref = copy.deepcopy(model)
    x = torch.randn(16, 8, dtype=torch.float64)
    step = BudgetedStep(model, lambda m, b: m(b).mean(), torch.optim.SGD(model.parameters(), lr=1.0),
                        budget="100GB", config=PlannerConfig(bits=(None,)))
    step(x)
    assert step.inplace is False
    # the slice that tried in place is trained again, not skipped: the step is the full batch's
    ref(x).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    relu = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    step = BudgetedStep(relu, lambda m, b: m(b).sum(), torch.optim.SGD(relu.parameters(), lr=0.0),
                        budget="100GB", config=PlannerConfig(bits=(None,)))
    step(torch.randn(16, 8))
    assert step.inplace is True


# -- errors ----------------------------------------------------------------------------------------------

def test_zero_sample_batch_names_the_batch():
    model = mlp()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB", tune_allocator=False)
    with pytest.raises(InvalidArgumentError, match=r"0 samples.*skip empty batches"):
        step((torch.randn(0, 64), torch.randint(0, 10, (0,))))
    assert step.profile is None and all(p.grad is None for p in model.parameters())


def test_a_batch_whose_tensors_disagree_on_dim_0_names_the_tensor():
    # NOTE [ Every tensor of a batch is split ]: a time-first sequence beside per-sample labels
    model = mlp()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB", tune_allocator=False)
    with pytest.raises(InvalidArgumentError, match=r"batch\[1\] \(shape \(32,\)\) has 32 along dim 0 where batch\[0\] "
                                                   r"\(shape \(20, 32, 64\)\) has 20.*sample dimension first"):
        step((torch.randn(20, 32, 64), torch.randint(0, 10, (32,))))
    assert step.profile is None and all(p.grad is None for p in model.parameters())


def _scaled_sgd_reference(model: nn.Module, batches, scaler: torch.amp.GradScaler) -> list[float]:
    """A hand-written float16-style loop: scaled loss, ``unscale_``, ``clip_grad_norm_``, ``scaler.step``,
    ``scaler.update``; the scale after each step."""
    opt, scales = torch.optim.SGD(model.parameters(), lr=0.5), []
    for batch in batches:
        opt.zero_grad()
        scaler.scale(ce(model, batch)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_scales_unscales_and_skips_the_steps_a_scaler_skips(monkeypatch):
    # The second batch's last sample is infinite: the scaler finds non-finite gradients, the step is skipped
    # and the scale halved, as scaler.step and scaler.update do; the other steps equal the hand-written loop's.
    torch.manual_seed(2)
    batches = [(torch.randn(48, 64, dtype=torch.float64), torch.randint(0, 10, (48,))) for _ in range(3)]
    batches[1][0][-1, 0] = math.inf
    ref = mlp().double()
    scales = _scaled_sgd_reference(ref, batches, torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1))
    model = mlp().double()
    monkeypatch.setattr(BudgetedStep, "_micro_batches", lambda self, plan, samples, fresh: -(-samples // 5))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.5), budget="100GB",
                        config=PlannerConfig(bits=(None,)), tune_allocator=False, max_grad_norm=0.05,
                        grad_scaler=scaler)
    got = []
    for batch in batches:
        step(batch)
        got.append(scaler.get_scale())
    assert got == scales == [2.0**13, 2.0**12, 2.0**13]
    assert [r.optimizer_parts > 0 for r in step.history] == [True, False, True]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("loss_fn", "error", "named"), [
    (lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), InvalidArgumentError, r"one floating-point value"),
    (lambda m, b: ce(m, b).item(), ArgumentTypeError, r"got float \(a Python number has no graph"),
    (lambda m, b: (ce(m, b), {}), ArgumentTypeError, r"as a tensor holding one value, got tuple"),
    (lambda m, b: ce(m, b).detach(), InvalidArgumentError, r"does not require grad"),
    (lambda m, b: b[1].sum(), InvalidArgumentError, r"got a torch.int64 tensor of shape \(\)"),
], ids=["per-sample", "float", "tuple", "detached", "integer"])
def test_a_loss_fn_that_returns_no_loss_is_named(loss_fn, error, named):
    model = mlp()
    step = BudgetedStep(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB",
                        tune_allocator=False)
    with pytest.raises(error, match=r"BudgetedStep loss_fn .*" + named):
        step((torch.randn(16, 64), torch.randint(0, 10, (16,))))
    assert all(p.grad is None for p in model.parameters())


def _clipped_sgd_reference(model: nn.Module, batch, max_norm: float, steps: int) -> list[float]:
    """A hand-written loop: full-batch loss, ``clip_grad_norm_``, SGD; the norms before clipping."""
    opt, norms = torch.optim.SGD(model.parameters(), lr=0.5), []
    for _ in range(steps):
        opt.zero_grad()
        ce(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    return norms


@pytest.mark.parametrize("budget", ["100GB", "tight"])
def test_max_grad_norm_clips_the_whole_batchs_gradient_as_a_hand_written_loop_does(budget, monkeypatch):
    # Clipping each micro-batch's gradient, or clipping before the last micro-batch was added, would give
    # other parameters; float64, so that the only difference from the reference is summation order.
    torch.manual_seed(2)
    batch = (torch.randn(48, 64, dtype=torch.float64), torch.randint(0, 10, (48,)))
    ref = mlp().double()
    norms = _clipped_sgd_reference(ref, batch, max_norm=0.05, steps=3)
    assert min(norms) > 0.05  # every step clips
    model = mlp().double()
    if budget == "tight":  # micro-batches of 5: the whole batch's gradient is their sum
        monkeypatch.setattr(BudgetedStep, "_micro_batches", lambda self, plan, samples, fresh: -(-samples // 5))
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.5), budget="100GB",
                        config=PlannerConfig(bits=(None,)), tune_allocator=False, max_grad_norm=0.05)
    for _ in range(3):
        step(batch)
    assert [r.grad_norm for r in step.history] == pytest.approx(norms, rel=1e-9)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


class FixedMeter:
    """A meter that always reads the same memory, so that what the step holds is the same every call."""

    resettable = False

    def __init__(self, held: int) -> None:
        self.held = held

    def start(self, *, trim: bool = True) -> int:
        return self.held

    def peak(self) -> int:
        return self.held

    def lifetime_peak(self) -> int:
        return self.held

    def current(self) -> int:
        return self.held

    def release(self) -> None:
        pass

    def refault_cost(self, block_bytes: int = 0) -> float:
        return 0.0


@pytest.mark.parametrize("profiled_first", [False, True])
def test_budget_of_exactly_the_named_floor_runs(monkeypatch, profiled_first):
    """``budget = err.required_bytes`` plans on the same model, also when the process held more than
    the budget before anything was measured (the floor named then used to be a lower bound)."""
    held = 400 * 10**6
    monkeypatch.setattr(step_module, "meter_for", lambda device: FixedMeter(held))
    model, batch = mlp(), (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    limit = {"now": "100GB" if profiled_first else held // 2}
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=1e-3), budget=lambda: limit["now"],
                        config=PlannerConfig(bits=(None,)), tune_allocator=False)
    if profiled_first:
        step(batch)
        limit["now"] = held + 1000
    with pytest.raises(BudgetTooSmallError) as info:
        step(batch)
    floor = info.value.required_bytes
    assert floor > held
    limit["now"] = floor
    step(batch)
    assert step.plan.predicted_peak_bytes <= floor
    limit["now"] = floor - 1
    with pytest.raises(BudgetTooSmallError):
        step(batch)


def test_constructor_errors_name_the_argument():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="reduction must be 'mean' or 'sum'"):
        BudgetedStep(model, ce, opt, budget="1GB", reduction="max")
    with pytest.raises(ArgumentTypeError, match="config must be a PlannerConfig"):
        BudgetedStep(model, ce, opt, budget="1GB", config={"bits": (None,)})
    with pytest.raises(ArgumentTypeError, match="compression must be a CompressionConfig"):
        BudgetedStep(model, ce, opt, budget="1GB", compression=2)
    with pytest.raises(ArgumentTypeError, match=r"pool must be a daftrain\.PagePool"):
        BudgetedStep(model, ce, opt, budget="1GB", pool=PoolConfig())
    with pytest.raises(ArgumentTypeError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
        BudgetedStep(model, ce, opt, budget="1GB", grad_scaler=object())
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(InvalidArgumentError, match="max_grad_norm must be a positive finite number"):
            BudgetedStep(model, ce, opt, budget="1GB", max_grad_norm=bad)
    for target in ({"avg_bits": 3.0}, {"packed_bytes": 10**6}, {"error_share": 0.01}):
        name = next(iter(target))
        with pytest.raises(InvalidArgumentError, match=f"compression must not name {name}"):
            BudgetedStep(model, ce, opt, budget="1GB", compression=CompressionConfig(bits="auto", **target))


class CountingMeter(FixedMeter):
    """Reads ``held`` now, and counts the releases asked of it."""

    def __init__(self, held: int) -> None:
        super().__init__(held)
        self.releases = 0

    def release(self) -> None:
        self.releases += 1


@pytest.mark.parametrize(("held", "releases"), [(1000, 7), (10, 0)])
def test_a_micro_batch_that_would_start_above_its_ceiling_releases_free_memory_first(held, releases):
    """Four micro-batches: every backward, and every micro-batch after the first, release the allocator's
    free memory when what is held is above the ceiling, and never when it is under (NOTE [ Metering a
    planned step ])."""
    from daftrain.budget.planner import Plan

    model = mlp()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB", tune_allocator=False)
    meter = CountingMeter(held)
    step._meter = meter
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    plan = Plan(budget_bytes=0, persistent_bytes=0, batch_size=16, micro_batch_size=4, num_micro_batches=4,
                checkpointed=(), bits=None, predicted_peak_bytes=0, predicted_step_s=0.0, alpha=1.0)
    step._accumulate(batch, plan, 4, 16.0, ceiling=100.0)
    assert meter.releases == releases


class FirstMicroBatchMeter(CountingMeter):
    """Holds ``held``; the first micro-batch peaks ``grown`` bytes above it."""

    def __init__(self, held: int, grown: int) -> None:
        super().__init__(held)
        self.grown = grown

    def peak(self) -> int:
        return self.held + self.grown


@pytest.mark.parametrize(("grown", "releases"), [(50, 6), (10, 0)])
def test_the_first_micro_batch_measured_tightens_the_room_of_the_next(grown, releases):
    """NOTE [ Metering a planned step ]: the model leaves the micro-batches room below a budget of 100
    (ceiling 90: 10 bytes each); a first micro-batch that measured 50 makes every later micro-batch and
    backward release free memory first, one that measured 10 nothing."""
    from daftrain.budget.planner import Plan

    model = mlp()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB", tune_allocator=False)
    meter = FirstMicroBatchMeter(60, grown)
    step._meter = meter
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    plan = Plan(budget_bytes=0, persistent_bytes=0, batch_size=16, micro_batch_size=4, num_micro_batches=4,
                checkpointed=(), bits=None, predicted_peak_bytes=0, predicted_step_s=0.0, alpha=1.0)
    step._accumulate(batch, plan, 4, 16.0, ceiling=90.0, budget=100)
    assert meter.releases == releases



def test_planned_steps_measure_their_time_against_the_model():
    """NOTE [ The cost model ], 4.: each planned step records its forward and backward time over the
    plan's prediction for its lever (bit-width, checkpointing or not); one not run yet takes the last
    lever's correction."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    model = mlp()
    step = BudgetedStep(model, ce, torch.optim.SGD(model.parameters(), lr=0.1), budget="100GB")
    step((x, y))  # the planning step: only the samples its slices left, run under the plan, are timed
    assert sum(len(r) for r in step._time_ratios.values()) <= 1
    for _ in range(4):
        step((x, y))
    key = (step.plan.bits, bool(step.plan.checkpointed))
    ratios = step._time_ratios[key]
    assert len(ratios) == 3  # the last three planned steps
    assert all(r > 0 for r in ratios)
    scale = step._time_scale()
    assert set(scale) == {(b, c) for b in step.profile.bits_options for c in (False, True)}
    assert scale[key] == pytest.approx(sorted(ratios)[1])
    assert all(v == scale[key] for other, v in scale.items() if other != key)  # not run: the last lever's
    # the next plan's prediction is the corrected one
    plan = plan_step(step.profile, budget_bytes=step.plan.budget_bytes, persistent_bytes=step.plan.persistent_bytes,
                     config=step.config, alpha=step.alpha, time_scale=scale)
    assert plan.predicted_step_s == pytest.approx(
        scale[plan.bits, bool(plan.checkpointed)] * plan_step(step.profile, budget_bytes=step.plan.budget_bytes,
                                     persistent_bytes=step.plan.persistent_bytes, config=step.config,
                                     alpha=step.alpha).predicted_step_s)


def test_optimizer_steps_in_parts_where_one_step_would_not_fit():
    """Large parameters, small activations: the whole Adam step's temporaries (all parameters' worth)
    do not fit the room the budget leaves, so the step goes in parts of the parameters (NOTE [ Stepping
    in parts ]), under the budget and to the same parameters as whole steps."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)], nn.Linear(1024, 10))
    twin = copy.deepcopy(model)
    batch = (torch.randn(4, 1024), torch.randint(0, 10, (4,)))
    params = sum(p.nbytes for p in model.parameters())  # 34 MB
    limit = {"now": "100GB"}
    step = BudgetedStep(model, ce, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True),
                        budget=lambda: limit["now"], config=PlannerConfig(bits=(None,)), tune_allocator=False)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-3, foreach=True)
    step(batch)  # the planning step, in slices; then the twin starts from where it left off
    twin.load_state_dict(model.state_dict())
    ref.load_state_dict(copy.deepcopy(step.optimizer.state_dict()))  # its own state tensors
    for q in twin.parameters():
        q.grad = torch.zeros_like(q)  # held through every step, as after each of the twin's steps
    reset_peak_rss()  # optimizer states allocated: room for the gradients and 24 MB (one step: 34 MB)
    limit["now"] = current_rss_bytes() + params + 24 * 2**20
    for _ in range(3):
        step(batch)
        ref.zero_grad(set_to_none=True)
        with weight_grads_in_place(twin):  # the step's gradients, bit for bit (one micro-batch)
            ce(twin, batch).backward()
        ref.step()
    assert step.history[0].optimizer_parts == 1  # the whole step fits 100 GB
    assert step.profile.optimizer_transient < 0.5 * params
    for rec in step.history[1:]:
        assert rec.optimizer_parts > 1 and rec.plan.num_micro_batches == 1, rec
        assert rec.peak_bytes <= rec.budget_bytes, (rec.peak_bytes, rec.budget_bytes)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)  # stepping in parts is bit-identical to one step


def test_a_parameter_larger_than_the_room_is_stepped_in_slices():
    """One parameter (64 MB) larger than the room the budget leaves (24 MB): the step goes in slices of
    it (NOTE [ Slicing a parameter ]), under the budget and to the same parameters as whole steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 10))
    twin = copy.deepcopy(model)
    batch = (torch.randn(4, 4096), torch.randint(0, 10, (4,)))
    params = sum(p.nbytes for p in model.parameters())
    limit = {"now": "100GB"}
    step = BudgetedStep(model, ce, torch.optim.Adam(model.parameters(), lr=1e-3),
                        budget=lambda: limit["now"], config=PlannerConfig(bits=(None,)), tune_allocator=False)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-3)
    step(batch)
    twin.load_state_dict(model.state_dict())
    ref.load_state_dict(copy.deepcopy(step.optimizer.state_dict()))
    for q in twin.parameters():
        q.grad = torch.zeros_like(q)
    reset_peak_rss()
    limit["now"] = current_rss_bytes() + params + 24 * 2**20
    for _ in range(3):
        step(batch)
        ref.zero_grad(set_to_none=True)
        with weight_grads_in_place(twin):
            ce(twin, batch).backward()
        ref.step()
    for rec in step.history[1:]:
        assert rec.optimizer_parts > 2, rec  # the weight in slices, and the rest
        assert rec.peak_bytes <= rec.budget_bytes, (rec.peak_bytes, rec.budget_bytes)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
