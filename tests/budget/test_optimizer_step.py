"""The optimizer step in parts (NOTE [ Stepping in parts ]): bit-identical to one step, temporaries
spanning one part, and one plain step wherever parts could change the result."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from daftrain.budget import optimizer_step
from daftrain.budget.optimizer_step import (
    leanest_part_bytes,
    optimizer_transient_bytes,
    part_bytes_within,
    step_in_parts,
)

F32 = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def _with_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


OPTIMIZERS = {
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, foreach=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parts_are_bit_identical_to_one_step(name):
    model = _model()
    twin = copy.deepcopy(model)
    groups = lambda m: [{"params": list(m[0].parameters())}, {"params": list(m[2:].parameters()), "lr": 3e-3}]  # noqa: E731
    opt, ref = OPTIMIZERS[name](groups(model)), OPTIMIZERS[name](groups(twin))
    largest = max(p.nbytes for p in model.parameters())
    for seed in range(3):  # state created, then used
        _with_grads(model, seed)
        _with_grads(twin, seed)
        model[4].bias.grad = twin[4].bias.grad = None  # a parameter without a gradient is left alone
        grads = [p.grad for p in model.parameters()]
        assert step_in_parts(opt, largest) == 3  # [w0, b0], [w2], [b2, w4]
        ref.step()
        assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))  # given back
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not opt.state.get(model[4].bias)


class _LargestAllocation(TorchDispatchMode):
    """The most bytes one op call allocates (a foreach op returns a list: summed); in-place ops return
    their inputs and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        inputs = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        outs = out if isinstance(out, (list, tuple)) else [out]
        self.largest = max(self.largest, sum(t.nbytes for t in outs if isinstance(t, torch.Tensor)
                                             and t.untyped_storage().data_ptr() not in inputs))
        return out


def test_a_foreach_step_in_parts_allocates_one_part_at_a_time():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    total = sum(p.nbytes for p in model.parameters())
    largest = leanest_part_bytes(opt)
    assert largest == 128 * 128 * F32
    seen = []
    for part in (None, largest):
        _with_grads(model, 0)
        with _LargestAllocation() as mode:
            step_in_parts(opt, part)
        seen.append(mode.largest)
    assert seen[0] >= total and seen[1] <= largest, (seen, total, largest)


def test_optimizers_that_read_other_parameters_step_whole():
    model = _model()
    _with_grads(model, 0)
    lbfgs = torch.optim.LBFGS(model.parameters())
    assert leanest_part_bytes(lbfgs) is None
    assert part_bytes_within(lbfgs, room=0.0, whole_scale=1.0, part_scale=1.0) is None
    adam = torch.optim.Adam(model.parameters(), foreach=True)
    calls = []
    adam.register_step_post_hook(lambda *_: calls.append(1))
    assert leanest_part_bytes(adam) is None  # a step hook would run once per part
    assert step_in_parts(adam, 1.0) == 1 and calls == [1]


def test_part_bytes_within_fits_the_room():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    whole = optimizer_transient_bytes(opt)
    largest = leanest_part_bytes(opt)
    assert part_bytes_within(opt, room=whole, whole_scale=1.0, part_scale=1.0) is None  # the whole step fits
    part = part_bytes_within(opt, room=0.85 * whole, whole_scale=1.0, part_scale=1.0)
    assert largest <= part and optimizer_transient_bytes(opt, part) <= 0.85 * whole
    assert optimizer_transient_bytes(opt, part * 1.01) > 0.85 * whole  # the largest part that fits
    assert part_bytes_within(opt, room=1.0, whole_scale=1.0, part_scale=1.0) == largest  # none fits: the leanest
    # measured scales: a whole step measured at half its estimate fits where the estimate did not
    assert part_bytes_within(opt, room=0.85 * whole, whole_scale=0.5, part_scale=1.0) is None


def test_a_for_loop_step_runs_foreach_in_parts():
    """A for-loop step holds about twice the largest parameter; in parts it runs foreach, one part at a
    time, where the two paths compute the same floats, and keeps its own path where they do not."""
    model = _model()
    largest = leanest_part_bytes(torch.optim.Adam(model.parameters()))
    loop = torch.optim.Adam(model.parameters(), foreach=False)
    assert optimizer_transient_bytes(loop, largest) == largest < optimizer_transient_bytes(loop)
    _with_grads(model, 0)
    with _LargestAllocation() as mode:
        step_in_parts(loop, largest)
    assert mode.largest <= largest and loop.param_groups[0]["foreach"] is False  # its setting given back
    nadam = torch.optim.NAdam(model.parameters(), foreach=False)
    assert optimizer_transient_bytes(nadam, largest) == optimizer_transient_bytes(nadam)
    assert part_bytes_within(nadam, room=1.0, whole_scale=1.0, part_scale=1.0) is None  # parts would not help


@pytest.mark.parametrize("cls", optimizer_step._FOREACH_IS_LOOP, ids=lambda c: c.__name__)
def test_foreach_and_for_loop_steps_compute_the_same_floats(cls):
    """What running a for-loop optimizer's parts with foreach rests on (NOTE [ Stepping in parts ])."""
    kwargs = {"lr": 1e-2} if cls is not torch.optim.Adadelta else {}
    if cls is torch.optim.SGD:
        kwargs.update(momentum=0.9, nesterov=True, weight_decay=0.01)
    model = _model()
    twin = copy.deepcopy(model)
    loop, fe = cls(model.parameters(), foreach=False, **kwargs), cls(twin.parameters(), foreach=True, **kwargs)
    for seed in range(5):
        _with_grads(model, seed)
        _with_grads(twin, seed)
        loop.step()
        fe.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


SLICED = {
    "SGD": {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adam": {"lr": 1e-2, "amsgrad": True},
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "Adamax": {"lr": 1e-2},
    "NAdam": {"lr": 1e-2},
    "RAdam": {"lr": 1e-2},
    "RMSprop": {"lr": 1e-3, "momentum": 0.9, "centered": True},
    "Adagrad": {"lr": 1e-2},
    "Adadelta": {},
    "ASGD": {"lr": 1e-2},
    "Rprop": {"lr": 1e-2},
}


def _same_state(a: torch.optim.Optimizer, pa: torch.Tensor, b: torch.optim.Optimizer, pb: torch.Tensor) -> bool:
    sa, sb = a.state[pa], b.state[pb]
    if sa.keys() != sb.keys():
        return False
    return all(torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k] for k in sa)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", optimizer_step._PER_PARAMETER, ids=lambda c: c.__name__)
def test_slices_are_bit_identical_to_one_step(cls, foreach, monkeypatch):
    """NOTE [ Slicing a parameter ]: slices of 777 elements (cutting vectors and rows) from the first
    step, which creates the state, on; every parameter and every state entry equal to one step's."""
    monkeypatch.setattr(optimizer_step, "_LEANEST_SLICE_BYTES", 0)
    model = _model()
    twin = copy.deepcopy(model)
    opt = cls(model.parameters(), foreach=foreach, **SLICED[cls.__name__])
    ref = cls(twin.parameters(), foreach=foreach, **SLICED[cls.__name__])
    part = 777 * F32
    for seed in range(3):
        _with_grads(model, seed)
        _with_grads(twin, seed)
        grads = [p.grad for p in model.parameters()]
        calls = step_in_parts(opt, part)
        ref.step()
        assert calls > len(grads)  # the weights went in slices
        assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))  # given back
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
        assert _same_state(opt, p, ref, q)
    assert opt.param_groups[0]["params"] == list(model.parameters()) and len(opt.state) == len(ref.state)


def test_a_sliced_step_allocates_one_slice_at_a_time(monkeypatch):
    monkeypatch.setattr(optimizer_step, "_LEANEST_SLICE_BYTES", 0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    _with_grads(model, 0)
    opt.step()  # the state exists: what is measured is the step's temporaries alone
    slice_bytes = 1000 * F32
    assert optimizer_transient_bytes(opt, slice_bytes) == slice_bytes
    _with_grads(model, 1)
    with _LargestAllocation() as mode:
        step_in_parts(opt, slice_bytes)
    assert 0 < mode.largest <= slice_bytes


def test_the_leanest_part_is_a_slice_of_the_largest_parameter():
    """A tied embedding no longer sets the floor: its slices are the leanest part, never below
    ``_LEANEST_SLICE_BYTES``; a parameter that cannot be sliced (here not contiguous) still does."""
    emb = nn.Embedding(1024, 512)  # 2 MiB
    opt = torch.optim.Adam(emb.parameters())
    assert leanest_part_bytes(opt) == optimizer_step._LEANEST_SLICE_BYTES < emb.weight.nbytes
    assert optimizer_transient_bytes(opt, 1.0) == optimizer_step._LEANEST_SLICE_BYTES
    assert part_bytes_within(opt, room=1.0, whole_scale=1.0, part_scale=1.0) == optimizer_step._LEANEST_SLICE_BYTES
    strided = nn.Parameter(torch.randn(512, 1024).t())
    opt = torch.optim.Adam([strided])
    assert leanest_part_bytes(opt) == strided.nbytes
    strided.grad = torch.randn(1024, 512)
    assert step_in_parts(opt, 1.0) == 1  # stepped whole
