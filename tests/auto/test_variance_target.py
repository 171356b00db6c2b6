"""``bits="auto"`` with ``error_share``: NOTE [ A variance target ] (policy.py) and NOTE [ Verifying a
variance target ] (calibration.py)."""

import warnings

import pytest
import torch
from torch import nn

import daftrain
from daftrain.auto.policy import BIAS_FLOOR_BITS, UNCALIBRATED_BITS
from daftrain.auto.tracing import nonlinear_saver


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256),
                         nn.GELU(), nn.Linear(256, 10))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)


def _gradient(model: nn.Module, ctx, x, y, loss_inside: bool = True) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with ctx:
        out = model(x)
        if loss_inside:
            loss = nn.functional.cross_entropy(out, y)
    if not loss_inside:
        loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_without_a_model_the_bound_holds_on_the_loss_graphs_parameters():
    model, (x, y) = _model(), _data()
    exact = _gradient(model, daftrain.compress(bits=None), x, y)
    ctx = daftrain.compress(bits="auto", error_share=0.01)
    for _ in range(2):
        _gradient(model, ctx, x, y)
    assert ctx.report().gradient_sq == pytest.approx(float(exact.double().pow(2).sum()), rel=0.05)
    g = _gradient(model, ctx, x, y)
    assert float((g - exact).pow(2).sum() / exact.pow(2).sum()) <= 2 * 0.01


@pytest.mark.parametrize("share", [0.002, 0.02])
def test_the_bound_holds_on_the_gradient_after_the_context_calibrates_by_itself(share):
    model, (x, y) = _model(), _data()
    exact = _gradient(model, daftrain.compress(bits=None, model=model), x, y)
    ctx = daftrain.compress(bits="auto", error_share=share, model=model)
    for _ in range(2):  # the adaptation step, then the step that calibrates on its loss
        _gradient(model, ctx, x, y)
    report = ctx.report()
    assert report.gradient_sq is not None and report.error_share <= share
    errors = []
    for _ in range(4):  # fresh rounding draws each step
        g = _gradient(model, ctx, x, y)
        errors.append(float((g - exact).pow(2).sum() / exact.pow(2).sum()))
    # The bound is on the expected squared error; four draws average out most of one draw's spread, and a
    # factor of 2 covers the rest (the calibrated estimate is within tens of percent here).
    assert sum(errors) / len(errors) <= 2 * share


def test_a_looser_bound_stores_fewer_bytes():
    model, (x, y) = _model(), _data()
    ratios = []
    for share in (0.001, 0.05):
        ctx = daftrain.compress(bits="auto", error_share=share, model=model)
        for _ in range(3):
            _gradient(model, ctx, x, y)
        ratios.append(ctx.stats.ratio)
    assert ratios[1] > ratios[0]


def test_before_a_calibration_every_tensor_gets_the_uncalibrated_bits_and_a_warning_says_why():
    model, (x, y) = _model(), _data()
    ctx = daftrain.compress(bits="auto", error_share=0.01, model=model)
    _gradient(model, ctx, x, y, loss_inside=False)
    with pytest.warns(UserWarning, match=r"no scalar loss computed under the context"):
        _gradient(model, ctx, x, y, loss_inside=False)
    report = ctx.report()
    assert report.gradient_sq is None
    assert {a.bits for a in report.slots} == {UNCALIBRATED_BITS}
    # calibrating by hand on a loss computed outside the context gives the bound
    model.zero_grad(set_to_none=True)
    with ctx:
        out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    ctx.calibrate(loss)
    loss.backward()
    assert ctx.report().gradient_sq is not None and ctx.report().error_share <= 0.01


def test_state_dict_restores_the_calibrated_allocation():
    model, (x, y) = _model(), _data()
    ctx = daftrain.compress(bits="auto", error_share=0.01, model=model)
    for _ in range(2):
        _gradient(model, ctx, x, y)
    state = ctx.state_dict()
    other = daftrain.compress(bits="auto", error_share=0.01, model=model)
    other.load_state_dict(state)
    assert [a.bits for a in other.report().slots] == [a.bits for a in ctx.report().slots]
    assert other.report().gradient_sq == ctx.report().gradient_sq
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated already: the next step does not look for a loss
        _gradient(model, other, x, y, loss_inside=False)
    with pytest.raises(daftrain.StateDictError, match="error_share"):
        daftrain.compress(bits="auto", error_share=0.02, model=model).load_state_dict(state)


@pytest.mark.parametrize("model_type", ["t5", "mt5", "gpt2", "hubert", "beit"])
def test_the_bound_holds_on_zoo_models(model_type):
    # Tiny Hugging Face models (benchmarks/bench_zoo.py): fixed 4 bits gives t5 and mt5 cosines of 0.970
    # and 0.949 against plain PyTorch (docs/zoo.md); a bound of 1 % keeps the cosine near 0.995. HuBERT
    # writes its masked time steps into a projection's output in place, which hid that output's
    # gradient from the estimate (a zero sensitivity, 0.83 before the verification measured it per
    # class); BEiT's LayerNorm inputs have constant rows that only the normalisation rule's encoding
    # keeps exact (a verification in plain groups kept every tensor exact).
    from daftrain.demo.models.transformers_zoo import TINY_ZOO, tiny_inputs, tiny_model, zoo_gradient

    kind, overrides = next((k, o) for m, k, o in TINY_ZOO if m == model_type)
    model = tiny_model(model_type, overrides)
    inputs = tiny_inputs(model, kind)
    ref = zoo_gradient(model, inputs)
    ctx = daftrain.compress(model=model, bits="auto", error_share=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", daftrain.QuantizationVarianceWarning)  # one batch: no minibatch noise
        for _ in range(3):
            grad = zoo_gradient(model, inputs, ctx, loss_under_context=True)
    assert ctx.report().error_share <= 0.01
    assert float(torch.nn.functional.cosine_similarity(grad, ref, dim=0)) >= 0.99
    assert ctx.stats.ratio >= 3  # not kept exact to meet the bound


def test_tensors_a_nonlinear_backward_reads_keep_the_bias_floor_however_loose_the_bound():
    # The bound is on variance; rounding under a nonlinear backward (GELU's input, tanh's output) is a
    # bias it does not count, which cost the character GPT-2 of the parity benchmark as much as fixed
    # 2 bits did. NOTE [ A variance target ].
    model, (x, y) = _model(), _data()
    ctx = daftrain.compress(bits="auto", error_share=1.0, model=model)
    for _ in range(3):
        _gradient(model, ctx, x, y)
    slots = ctx.report().slots
    nonlinear = [a for a in slots if nonlinear_saver(a.op)]
    assert {a.op for a in nonlinear} >= {"gelu", "tanh+linear"}  # tanh and the next linear save one tensor
    assert all(a.bits is None or a.bits >= BIAS_FLOOR_BITS for a in nonlinear)
    assert any(a.bits == 2 for a in slots if not nonlinear_saver(a.op))  # the loose bound lowers the rest
