"""Validation of ``compress.state_dict()`` on load: every field, and whose state it is."""

import copy
import json

import pytest
import torch
from torch import nn

import daftrain
from daftrain.auto import StateDictError
from daftrain.auto.state import checksum

pytestmark = pytest.mark.filterwarnings("ignore::daftrain.QuantizationVarianceWarning")


def mlp(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Linear(hidden, 10))


def auto(model: nn.Module | None) -> daftrain.compress:
    return daftrain.compress(bits="auto", avg_bits=2.0, model=model, adapt_interval=3, seed=3, min_numel=0)


def train(model: nn.Module, ctx: daftrain.compress, steps: int = 2) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)


def resealed(state: dict) -> dict:
    """``state`` with its checksum recomputed, as an edit that knows the format would do."""
    payload = {k: v for k, v in state.items() if k != "checksum"}
    return {**payload, "checksum": checksum(payload)}


@pytest.fixture(scope="module")
def saved() -> dict:
    model = mlp()
    ctx = auto(model)
    train(model, ctx, 2)
    state = json.loads(json.dumps(ctx.state_dict()))
    assert state["step"] == 1 and state["estimated_at"] == 0 and len(state["slots"]) >= 2
    return state


def slot0(field, value):
    return lambda s: s["slots"][0].__setitem__(field, value)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s.__setitem__("step", -2), "step"),
        (lambda s: s.__setitem__("step", 2**70), "step"),
        (lambda s: s.__setitem__("step", True), "step"),
        (lambda s: s.__setitem__("step", 1.0), "step"),
        (lambda s: s.__setitem__("next_adapt", -1), "next_adapt"),
        (lambda s: s.__setitem__("next_adapt", 10**9), "next_adapt"),  # past step + adapt_interval
        (lambda s: s.__setitem__("estimated_at", -1), "estimated_at"),
        (lambda s: s.__setitem__("estimated_at", 5), "estimated_at"),  # after the saved step
        (lambda s: s.__setitem__("estimated_at", None), "estimated_at"),
        (lambda s: s.__setitem__("reestimate", 1), "reestimate"),
        (lambda s: s.__setitem__("grad_variance", -1.0), "grad_variance"),
        (lambda s: s.__setitem__("grad_variance", "1.0"), "grad_variance"),
        (lambda s: s.__setitem__("model", 7), "model"),
        (lambda s: s.__setitem__("slots", {}), "slots"),
        (lambda s: s.__setitem__("extra", 1), r"has unexpected fields \['extra'\]"),
        (lambda s: s.pop("reestimate"), r"lacks the fields \['reestimate'\]"),
        (lambda s: s["slots"].__setitem__(0, [1, 2]), r"slots\[0\] must be a mapping"),
        (lambda s: s["slots"][0].pop("op"), r"slots\[0\] lacks the fields \['op'\]"),
        (slot0("index", -1), r"slots\[0\]\.index"),
        (slot0("index", "0"), r"slots\[0\]\.index"),
        (slot0("numel", -5), r"slots\[0\]\.numel"),
        (slot0("numel", 0), r"slots\[0\]\.numel"),
        (slot0("numel", 10**30), r"slots\[0\]\.numel"),
        (slot0("shape", [-32, -64]), r"slots\[0\]\.shape\[0\]"),
        (slot0("shape", [10**6, 10**6]), r"slots\[0\]\.shape"),  # does not hold numel values
        (slot0("shape", "32x64"), r"slots\[0\]\.shape"),
        (slot0("dtype", "int64"), r"slots\[0\]\.dtype"),
        (slot0("itemsize", 8), r"slots\[0\]\.itemsize"),
        (slot0("op", 3), r"slots\[0\]\.op"),
        (slot0("producer", None), r"slots\[0\]\.producer"),
        (slot0("bits", 3), r"slots\[0\]\.bits"),
        (slot0("bits", True), r"slots\[0\]\.bits"),
        (slot0("min_bits", 16), r"slots\[0\]\.min_bits"),
        (slot0("min_bits", None), r"slots\[0\]\.min_bits"),
        (slot0("grad_sq", -1.0), r"slots\[0\]\.grad_sq"),
        (slot0("plain_r2", float("inf")), r"slots\[0\]\.plain_r2"),
        (slot0("zero_r2", -0.5), r"slots\[0\]\.zero_r2"),
        (slot0("plain_energy", [1.0]), r"slots\[0\]\.plain_energy"),
        (slot0("plain_energy", [1.0, -2.0, 3.0]), r"slots\[0\]\.plain_energy\[1\]"),
        (slot0("plain_energy", 1.0), r"slots\[0\]\.plain_energy"),
        (slot0("sensitivity", "1.0"), r"slots\[0\]\.sensitivity"),
        (slot0("sensitivity", float("nan")), r"slots\[0\]\.sensitivity"),
        (lambda s: s["slots"][1].__setitem__("index", s["slots"][0]["index"]), "share one index"),
    ],
)
def test_an_edited_state_with_a_valid_checksum_is_refused_naming_the_field(saved, edit, field):
    """Regression: a state whose checksum was recomputed after an edit was loaded with negative or absurd
    steps, sizes and shapes (``float()`` of a string included); every field is now checked."""
    state = copy.deepcopy(saved)
    edit(state)
    target = auto(mlp())
    with pytest.raises(StateDictError, match=field):
        target.load_state_dict(resealed(state))
    assert target.report() is None and target.step == -1  # nothing changed


def test_the_unedited_state_loads(saved):
    target = auto(mlp())
    target.load_state_dict(resealed(copy.deepcopy(saved)))
    assert target.step == saved["step"] and target.report() is not None


@pytest.mark.parametrize(("step", "ok"), [(-1, True), (7, True), (-2, False), (2**63, False), ("3", False)])
def test_fixed_bits_state_step_is_checked(step, ok):
    state = resealed(dict(daftrain.compress(bits=2).state_dict(), step=step))
    target = daftrain.compress(bits=2)
    if ok:
        target.load_state_dict(state)
        assert target.step == step
    else:
        with pytest.raises(StateDictError, match="step"):
            target.load_state_dict(state)
        assert target.step == -1


def test_a_state_saved_without_a_model_loads_only_into_a_context_without_one():
    """Regression: a fresh context with ``model=`` accepted any state saved without one, another model's
    included (NOTE [ Whose state ] in auto/state.py)."""
    small, other = mlp(), mlp(hidden=32)  # another model: other hidden width, other slots
    anonymous = auto(None)
    train(other, anonymous)
    state = anonymous.state_dict()
    assert state["model"] is None and state["slots"]
    with pytest.raises(StateDictError, match="without model="):
        auto(small).load_state_dict(state)
    fresh = auto(None)
    fresh.load_state_dict(state)  # nothing to check a fingerprint against on either side
    assert fresh.report().to_dict() == anonymous.report().to_dict()
    # once a context without a model has allocated, its slots tell another model's state apart
    seen = auto(None)
    train(small, seen)
    with pytest.raises(StateDictError, match="another model"):
        seen.load_state_dict(state)


def test_a_state_saved_with_a_model_needs_a_context_with_that_model():
    model = mlp()
    ctx = auto(model)
    train(model, ctx)
    state = ctx.state_dict()
    with pytest.raises(StateDictError, match="no model="):
        auto(None).load_state_dict(state)
    with pytest.raises(StateDictError, match="another model"):
        auto(mlp(hidden=32)).load_state_dict(state)
    same = auto(mlp(seed=1))  # same architecture: same fingerprint
    same.load_state_dict(state)
    assert same.report().to_dict() == ctx.report().to_dict()
