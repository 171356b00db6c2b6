"""Probing: measurements leave no trace in training, and the profile they make is what the planner needs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from daftrain.budget.budgets import BudgetTooSmallError
from daftrain.budget.memory import current_rss_bytes, meter_for
from daftrain.budget.planner import PlannerConfig
from daftrain.budget.probe import Prober
from daftrain.budget.step import BudgetedStep
from daftrain.config import CompressionConfig


def prober(model: nn.Module, loss_fn, config: PlannerConfig) -> Prober:
    from daftrain.budget.segments import find_segments

    return Prober(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0), find_segments(model), config,
                  CompressionConfig(), meter_for(torch.device("cpu")))


def test_probe_leaves_no_trace():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2)),
                          nn.Sequential(nn.Linear(16, 4)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = prober(model, lambda m, b: m(b).pow(2).mean(), PlannerConfig(bits=(None,)))
    x = torch.randn(64, 16)
    rng = torch.get_rng_state()
    profile, _ = p.probe(x, 10**11, current_rss_bytes(), inplace=False)
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(q.grad is None for q in model.parameters())
    assert profile.batch_size == 64 and [s.name for s in profile.segments] == ["0", "1"]


def test_profile_counts_what_each_segment_saves():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Sequential(nn.Linear(32, 32), nn.GELU()))
    p = prober(model, lambda m, b: m(b).pow(2).mean(), PlannerConfig(bits=(None,)))
    profile, _ = p.probe(torch.randn(16, 32), 10**11, current_rss_bytes(), inplace=False)
    f32 = 4
    for seg in profile.segments:
        # per sample: the Linear's input, and GELU's input
        assert seg.saved[None] == 2 * 32 * f32, seg
        assert seg.input_bytes == 32 * f32
    assert profile.optimizer_transient == 3 * 32 * 32 * f32


def test_model_without_segments_probed_without_headroom_names_a_budget():
    """A model with no children has no segments; probing it with no headroom (every segment
    checkpointed, i.e. none) still gives a profile the planner can name a budget from."""
    model = nn.Linear(64, 64)
    step = BudgetedStep(model, lambda m, b: m(b).pow(2).mean(), torch.optim.SGD(model.parameters(), lr=0.0),
                        budget=10**6, config=PlannerConfig(bits=(None,)), tune_allocator=False)
    with pytest.raises(BudgetTooSmallError) as info:
        step(torch.randn(32, 64))
    assert info.value.required_bytes > info.value.budget_bytes and "already holds" in str(info.value)
