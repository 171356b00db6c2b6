"""The planning step: its measuring slices train the batch exactly once, its counting forwards leave no
trace, and the profile it makes is what the planner needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from daftrain.budget.budgets import BudgetTooSmallError
from daftrain.budget.memory import meter_for, missing_state_bytes
from daftrain.budget.planner import PlannerConfig
from daftrain.budget.probe import Prober
from daftrain.budget.segments import find_segments
from daftrain.budget.step import BudgetedStep
from daftrain.config import CompressionConfig
from daftrain.rss import current_rss_bytes


def prober(model: nn.Module, loss_fn, config: PlannerConfig, grads_in_place: bool = False) -> Prober:
    return Prober(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0), find_segments(model), config,
                  CompressionConfig(), meter_for(torch.device("cpu")), grads_in_place=grads_in_place)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Sequential(nn.Linear(32, 32), nn.GELU()))


def full_batch_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_counting_forward_leaves_no_trace():
    """The counting forwards (one sample, saved tensors dropped) change no buffer and no RNG state."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2)),
                          nn.Sequential(nn.Linear(16, 4)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = prober(model, lambda m, b: m(b).pow(2).mean(), PlannerConfig(bits=(None,)))
    x = torch.randn(64, 16)
    rng = torch.get_rng_state()
    m1, count = p._count(x)
    assert m1 == 2  # BatchNorm1d cannot train on one sample
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(q.grad is None for q in model.parameters())
    assert count.saved > 0


@pytest.mark.parametrize("keep", [0, 5])
def test_planning_step_trains_the_first_samples_once(keep):
    """The slices grow x4 from one sample while they fit (1, 4, 16, 64 of 100) and train each sample
    once: the accumulated gradient is the mean loss's gradient over those samples, weighted by their
    share of the batch. The rest (at least ``keep``) is left to the plan."""
    torch.manual_seed(3)
    model = mlp()
    x = torch.randn(100, 32)
    p = prober(model, lambda m, b: m(b).pow(2).mean(), PlannerConfig(bits=(None,)))
    first = p.planning_step(x, 10**11, current_rss_bytes(), inplace=False, share=lambda part: part.shape[0] / 100,
                            keep=keep)
    n = first.trained
    assert n == 85 and 100 - n >= keep
    trained = [q.grad.clone() for q in model.parameters()]
    expected = [g * n / 100 for g in full_batch_grads(model, x[:n])]
    for g, e in zip(trained, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        ref = float(model(x[:n]).pow(2).mean()) * n / 100
    assert first.loss == pytest.approx(ref, rel=1e-5)
    assert first.profile.batch_size == 100 and [s.name for s in first.profile.segments] == ["0", "1"]


def test_profile_counts_what_each_segment_saves():
    torch.manual_seed(7)
    model = mlp()
    p = prober(model, lambda m, b: m(b).pow(2).mean(), PlannerConfig(bits=(None,)))
    first = p.planning_step(torch.randn(16, 32), 10**11, current_rss_bytes(), inplace=False, share=lambda _: 1 / 16)
    f32 = 4
    for seg in first.profile.segments:
        # per sample: the Linear's input, and GELU's input
        assert seg.saved[None] == 2 * 32 * f32, seg
        assert seg.input_bytes == 32 * f32
    # SGD on CPU steps per parameter; its leanest step is foreach over parts of the largest parameter
    assert first.profile.optimizer_transient == 32 * 32 * f32


def test_compressed_slices_only_where_exact_is_bound():
    """A roomy budget trains exactly and measures no bit-width; a budget that exact activations cannot
    fill in one slice trains compressed slices too, and the profile then has every allowed bit-width
    with compressed saved bytes well under the exact ones."""
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(4)])
    loss_fn = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    x = torch.randn(2048, 1024)
    share = lambda part: part.shape[0] / 2048  # noqa: E731
    # weight gradients added into .grad, as BudgetedStep runs it: every slice then allocates alike; no
    # time penalty assumed for compression, so that whether it can pay turns on the memory alone (on
    # this model the default factor's 10 % per sample about equals what fewer micro-batches save)
    p = prober(model, loss_fn, PlannerConfig(compression_reserve=0, compressed_time_factor=1.0), grads_in_place=True)
    first = p.planning_step(x, 10**11, current_rss_bytes(), inplace=False, share=share)
    assert first.profile.bits_options == (None,) and first.trained == 1365  # 1 + 4 + 16 + 64 + 256 + 1024
    model.zero_grad(set_to_none=True)
    # exact activations: 8 saved rows of 4 KiB per sample, 64 MiB for the batch; allow about a quarter
    # (a room well above the RSS noise of one measurement, a few MiB)
    held = current_rss_bytes() + missing_state_bytes(model, p.optimizer)
    first = p.planning_step(x, held + 16 * 2**20 / 0.9, held, inplace=False, share=share)
    assert set(first.profile.bits_options) == {None, 8, 4, 2}
    assert first.trained < 2048
    exact = first.profile.outside[None] + sum(s.saved[None] for s in first.profile.segments)
    two = first.profile.outside[2] + sum(s.saved[2] for s in first.profile.segments)
    assert 0 < two < 0.2 * exact


def test_no_compressed_slices_where_the_kernels_footprint_would_cost_more_than_it_saves():
    """The kernels' one-time footprint stays in the process: where it takes most of the room, compressed
    plans estimated at their best (bits / 32 of the exact bytes, ``compressed_time_factor`` times the
    exact time per sample) on what it leaves lose to the exact plan on the whole room, and the planning
    step measures none (NOTE [ Measuring the cost model ], 3.)."""
    torch.manual_seed(1)
    # deep and narrow: saved activations (64 rows of 1 KiB per sample) outweigh the working set
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(32)])
    loss_fn = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    x = torch.randn(256, 256)
    share = lambda part: part.shape[0] / 256  # noqa: E731
    room = 4 * 2**20  # a quarter of the exact activations (16 MiB): exact needs several micro-batches
    # with 2**19 bytes left, 2-bit plans need about as many micro-batches as exact ones: a time factor
    # of 2 decides it with a wide margin (of 1.1, the estimate's own noise could)
    for reserve, factor, measured in ((0, 1.1, {None, 8, 4, 2}), (room - 2**19, 2.0, {None})):
        config = PlannerConfig(compression_reserve=reserve, compressed_time_factor=factor)
        p = prober(model, loss_fn, config, grads_in_place=True)  # every slice allocates alike
        p.planning_step(x, 10**11, current_rss_bytes(), inplace=False, share=share)  # the first backward
        model.zero_grad(set_to_none=True)
        held = current_rss_bytes() + missing_state_bytes(model, p.optimizer)
        first = p.planning_step(x, held + room / 0.9, held, inplace=False, share=share)
        assert set(first.profile.bits_options) == measured, reserve
        model.zero_grad(set_to_none=True)


def test_first_step_is_a_plain_step():
    """The first (planning) step of BudgetedStep updates the model as one plain step on the whole batch."""
    torch.manual_seed(11)
    model, twin = mlp(), mlp()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(64, 32)
    step = BudgetedStep(model, lambda m, b: m(b).pow(2).mean(), torch.optim.SGD(model.parameters(), lr=0.1),
                        budget=10**11, config=PlannerConfig(bits=(None,)), tune_allocator=False)
    loss = step(x)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    ref = twin(x).pow(2).mean()
    ref.backward()
    opt.step()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert step.history[0].planning and not any(q.grad is not None for q in model.parameters())


def test_model_without_segments_probed_without_headroom_names_a_budget():
    """A model with no children has no segments; probing it with no headroom (every segment
    checkpointed, i.e. none) still gives a profile the planner can name a budget from."""
    model = nn.Linear(64, 64)
    step = BudgetedStep(model, lambda m, b: m(b).pow(2).mean(), torch.optim.SGD(model.parameters(), lr=0.0),
                        budget=10**6, config=PlannerConfig(bits=(None,)), tune_allocator=False)
    with pytest.raises(BudgetTooSmallError) as info:
        step(torch.randn(32, 64))
    assert info.value.required_bytes > info.value.budget_bytes and "already holds" in str(info.value)
    assert model.weight.grad is None  # what the planning step trained is dropped with the failed step
