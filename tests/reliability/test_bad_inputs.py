"""Bad inputs across the public API raise a ``DaftrainError`` naming the parameter, at the call that takes
them: never an ``AttributeError`` or ``ZeroDivisionError`` from deep inside, and never silence.

Each table row: an id, the call, the error class expected (a ``DaftrainError`` subclass) and a pattern the
message must match, which names the parameter."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

import daftrain
from daftrain import (
    ArgumentTypeError,
    Budget,
    BudgetedStep,
    BudgetError,
    CompressionConfig,
    DaftrainError,
    FixedGrowth,
    InvalidArgumentError,
    LayoutError,
    PagePool,
    PlannerConfig,
    PoolConfig,
)

NAN, INF = math.nan, math.inf
Case = tuple[str, Callable[[], object], type[DaftrainError], str]


def _check(call: Callable[[], object], error: type[DaftrainError], pattern: str) -> None:
    with pytest.raises(DaftrainError) as info:
        call()
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {info.value}"
    assert str(info.value).strip(), "an empty message"
    assert re.search(pattern, str(info.value)), f"{pattern!r} not in: {info.value}"


def _rows(cases: list[Case | object]) -> list[object]:
    return [pytest.param(*c[1:], id=c[0]) if isinstance(c, tuple) and isinstance(c[0], str) else c for c in cases]


# -- compress and CompressionConfig ---------------------------------------------------------------------

COMPRESS: list[Case] = [
    ("bits=3", lambda: daftrain.compress(bits=3), InvalidArgumentError, r"^bits must be one of"),
    ("bits=0", lambda: daftrain.compress(bits=0), InvalidArgumentError, r"^bits must be one of"),
    ("bits='AUTO'", lambda: daftrain.compress(bits="AUTO"), InvalidArgumentError, r"^bits .*got 'AUTO'"),
    ("bits=2.0", lambda: daftrain.compress(bits=2.0), InvalidArgumentError, r"^bits .*got 2\.0"),
    ("bits=True", lambda: daftrain.compress(bits=True), InvalidArgumentError, r"^bits .*got True"),
    ("group_size=33", lambda: daftrain.compress(group_size=33), InvalidArgumentError, r"^group_size .*got 33"),
    ("group_size=0", lambda: daftrain.compress(group_size=0), InvalidArgumentError, r"^group_size"),
    ("group_size=1.5", lambda: daftrain.compress(group_size=1.5), ArgumentTypeError, r"^group_size must be an int"),
    ("group_size=2**20", lambda: daftrain.compress(group_size=2**20), InvalidArgumentError, r"^group_size"),
    ("min_numel=-1", lambda: daftrain.compress(min_numel=-1), InvalidArgumentError, r"^min_numel .*got -1"),
    ("min_numel=1.5", lambda: daftrain.compress(min_numel=1.5), InvalidArgumentError, r"^min_numel"),
    ("seed=-1", lambda: daftrain.compress(seed=-1), InvalidArgumentError, r"^seed .*got -1"),
    ("seed=2**64", lambda: daftrain.compress(seed=2**64), InvalidArgumentError, r"^seed"),
    ("seed='0'", lambda: daftrain.compress(seed="0"), InvalidArgumentError, r"^seed"),
    ("asynchronous='yes'", lambda: daftrain.compress(asynchronous="yes"), ArgumentTypeError, r"^asynchronous"),
    ("pack_bool=1", lambda: daftrain.compress(pack_bool=1), ArgumentTypeError, r"^pack_bool"),
    ("decode_buffers=None", lambda: daftrain.compress(decode_buffers=None), ArgumentTypeError, r"^decode_buffers"),
    ("avg_bits with fixed bits", lambda: daftrain.compress(bits=2, avg_bits=2.0), InvalidArgumentError,
     r"avg_bits .*only apply with bits='auto'"),
    ("avg_bits=nan", lambda: daftrain.compress(bits="auto", avg_bits=NAN), InvalidArgumentError, r"^avg_bits"),
    ("avg_bits=0.5", lambda: daftrain.compress(bits="auto", avg_bits=0.5), InvalidArgumentError, r"^avg_bits"),
    ("avg_bits and packed_bytes", lambda: daftrain.compress(bits="auto", avg_bits=2.0, packed_bytes=10),
     InvalidArgumentError, r"avg_bits or as packed_bytes"),
    ("error_share=0", lambda: daftrain.compress(bits="auto", error_share=0.0), InvalidArgumentError,
     r"^error_share"),
    ("packed_bytes=0", lambda: daftrain.compress(bits="auto", packed_bytes=0), InvalidArgumentError,
     r"^packed_bytes"),
    ("adapt_interval=0", lambda: daftrain.compress(bits="auto", adapt_interval=0), InvalidArgumentError,
     r"^adapt_interval"),
    ("variance_warning=nan", lambda: daftrain.compress(bits="auto", variance_warning=NAN), InvalidArgumentError,
     r"^variance_warning"),
    ("unknown keyword", lambda: daftrain.compress(bitz=2), ArgumentTypeError, r"unknown keyword arguments \['bitz'\]"),
    ("model=123", lambda: daftrain.compress(model=123), ArgumentTypeError, r"^model must be a torch\.nn\.Module"),
    ("pool='x'", lambda: daftrain.compress(pool="x"), ArgumentTypeError, r"^pool must be a PagePool"),
    ("config=2", lambda: daftrain.compress(2), ArgumentTypeError, r"^config must be a CompressionConfig"),
    ("CompressionConfig(bits=16)", lambda: CompressionConfig(bits=16), InvalidArgumentError, r"^bits"),
    ("CompressionConfig(group_size='256')", lambda: CompressionConfig(group_size="256"), ArgumentTypeError,
     r"^group_size"),
]


@pytest.mark.parametrize(("call", "error", "pattern"), _rows(COMPRESS))
def test_compress_and_its_config_refuse_bad_values(call, error, pattern):
    _check(call, error, pattern)


def test_unknown_keyword_is_still_a_type_error():
    """Python's own wording for an unknown keyword is a ``TypeError``; callers catching that still do."""
    with pytest.raises(TypeError, match="bitz"):
        daftrain.compress(bitz=2)


# -- the pool -------------------------------------------------------------------------------------------

POOL: list[Case] = [
    ("max_bytes=-1", lambda: PoolConfig(max_bytes=-1), InvalidArgumentError, r"^max_bytes must be >= 1, got -1"),
    ("max_bytes=0", lambda: PoolConfig(max_bytes=0), InvalidArgumentError, r"^max_bytes"),
    ("max_bytes=1.5", lambda: PoolConfig(max_bytes=1.5), InvalidArgumentError, r"^max_bytes must be an int"),
    ("page_size=5000", lambda: PoolConfig(page_size=5000), InvalidArgumentError, r"^page_size must be a power of two"),
    ("page_size=1024", lambda: PoolConfig(page_size=1024), InvalidArgumentError, r"^page_size"),
    ("page_size=True", lambda: PoolConfig(page_size=True), InvalidArgumentError, r"^page_size"),
    ("page_size=2**31", lambda: PoolConfig(page_size=2**31), InvalidArgumentError, r"^page_size"),
    ("initial_bytes=-1", lambda: PoolConfig(initial_bytes=-1), InvalidArgumentError, r"^initial_bytes"),
    ("initial_bytes > max_bytes", lambda: PoolConfig(initial_bytes=2**20, max_bytes=2**16), InvalidArgumentError,
     r"initial_bytes .* must not exceed max_bytes"),
    ("growth='x'", lambda: PoolConfig(growth="x"), InvalidArgumentError, r"^growth must be"),
    ("spill='yes'", lambda: PoolConfig(spill="yes"), InvalidArgumentError, r"^spill must be a bool"),
    ("spill_dir=3", lambda: PoolConfig(spill_dir=3), InvalidArgumentError, r"^spill_dir must be None or a path"),
    ("pin_memory=1", lambda: PoolConfig(pin_memory=1), InvalidArgumentError, r"^pin_memory"),
    ("FixedGrowth(-1)", lambda: FixedGrowth(-1), InvalidArgumentError, r"step_bytes"),
    ("PagePool('x')", lambda: PagePool("x"), ArgumentTypeError, r"^config must be a PoolConfig"),
]


@pytest.mark.parametrize(("call", "error", "pattern"), _rows(POOL))
def test_pool_config_refuses_bad_values(call, error, pattern):
    _check(call, error, pattern)
# A spill_dir that is a regular file is refused at the first spill, with a PoolError naming spill_dir and
# nothing lost: tests/pool/test_pool_spill_files.py::test_spill_dir_below_a_regular_file_raises_pool_error.


# -- budgets, the planner and BudgetedStep --------------------------------------------------------------


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(**overrides: object) -> BudgetedStep:
    model = _model()
    kwargs: dict[str, object] = {
        "model": model, "loss_fn": lambda m, b: m(b).sum(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "budget": "1GB",
    }
    kwargs.update(overrides)
    return BudgetedStep(kwargs.pop("model"), kwargs.pop("loss_fn"), kwargs.pop("optimizer"), **kwargs)



BUDGET: list[Case | object] = [
    ("Budget('abc')", lambda: Budget("abc"), BudgetError, r"cannot read 'abc' as a memory size \(budget\)"),
    ("Budget(-1)", lambda: Budget(-1), BudgetError, r"\(budget\) cannot be negative"),
    ("Budget(nan)", lambda: Budget(NAN), BudgetError, r"\(budget\) must be finite"),
    ("Budget(inf)", lambda: Budget(INF), BudgetError, r"\(budget\) must be finite"),
    ("Budget(True)", lambda: Budget(True), BudgetError, r"\(budget\)"),
    ("Budget([])", lambda: Budget([]), BudgetError, r"\(budget\) must be a str, int or float"),
    ("Budget('12 parsecs')", lambda: Budget("12 parsecs"), BudgetError, r"\(budget\)"),
    ("Budget(callable -> 'zz').bytes()", lambda: Budget(lambda: "zz").bytes(), BudgetError, r"\(budget\)"),
    ("Budget.system(2.0)", lambda: Budget.system(2.0), BudgetError, r"Budget\.system fraction"),
    ("Budget.system(nan)", lambda: Budget.system(NAN), BudgetError, r"Budget\.system fraction"),
    ("Budget.system(reserve='x')", lambda: Budget.system(0.5, reserve="x"), BudgetError, r"'x'"),
    ("BudgetedStep(budget='abc')", lambda: _step(budget="abc"), BudgetError, r"'abc' as a memory size \(budget\)"),
    ("BudgetedStep(budget=-1)", lambda: _step(budget=-1), BudgetError, r"\(budget\) cannot be negative"),
    ("BudgetedStep(budget=nan)", lambda: _step(budget=NAN), BudgetError, r"\(budget\) must be finite"),
    ("BudgetedStep(budget=None)", lambda: _step(budget=None), BudgetError, r"\(budget\)"),
    ("BudgetedStep(reduction='avg')", lambda: _step(reduction="avg"), InvalidArgumentError, r"reduction must be"),
    ("BudgetedStep(config=dict)", lambda: _step(config={}), ArgumentTypeError, r"config must be a PlannerConfig"),
    ("BudgetedStep(compression=2)", lambda: _step(compression=2), ArgumentTypeError,
     r"compression must be a CompressionConfig"),
    pytest.param(lambda: _step(model=123), ArgumentTypeError, r"model must be a torch\.nn\.Module",
                 id="BudgetedStep(model=123)"),
    pytest.param(lambda: _step(loss_fn=5), ArgumentTypeError, r"loss_fn must be callable",
                 id="BudgetedStep(loss_fn=5)"),
    pytest.param(lambda: _step(optimizer=None), ArgumentTypeError, r"optimizer must be a torch\.optim\.Optimizer",
                 id="BudgetedStep(optimizer=None)"),
    ("PlannerConfig(bits=(3,))", lambda: PlannerConfig(bits=(3,)), InvalidArgumentError, r"PlannerConfig\.bits"),
    ("PlannerConfig(bits=[2])", lambda: PlannerConfig(bits=[2]), InvalidArgumentError, r"PlannerConfig\.bits"),
    ("PlannerConfig(bits=())", lambda: PlannerConfig(bits=()), InvalidArgumentError, r"PlannerConfig\.bits"),
    ("PlannerConfig(bits=(True,))", lambda: PlannerConfig(bits=(True,)), InvalidArgumentError,
     r"PlannerConfig\.bits"),
    ("PlannerConfig(checkpoint=1)", lambda: PlannerConfig(checkpoint=1), ArgumentTypeError,
     r"PlannerConfig\.checkpoint"),
    ("PlannerConfig(safety=nan)", lambda: PlannerConfig(safety=NAN), InvalidArgumentError, r"PlannerConfig\.safety"),
    ("PlannerConfig(safety=0)", lambda: PlannerConfig(safety=0), InvalidArgumentError, r"PlannerConfig\.safety"),
    ("PlannerConfig(safety='x')", lambda: PlannerConfig(safety="x"), ArgumentTypeError, r"PlannerConfig\.safety"),
    ("PlannerConfig(prefer_exact_within=1)", lambda: PlannerConfig(prefer_exact_within=1), InvalidArgumentError,
     r"PlannerConfig\.prefer_exact_within"),
    ("PlannerConfig(compression_reserve=-1)", lambda: PlannerConfig(compression_reserve=-1), InvalidArgumentError,
     r"PlannerConfig\.compression_reserve"),
    ("PlannerConfig(max_alpha=nan)", lambda: PlannerConfig(max_alpha=NAN), InvalidArgumentError,
     r"PlannerConfig\.max_alpha"),
    ("PlannerConfig(max_alpha=0.5)", lambda: PlannerConfig(max_alpha=0.5), InvalidArgumentError,
     r"PlannerConfig\.max_alpha"),
    ("PlannerConfig(compressed_time_factor=nan)", lambda: PlannerConfig(compressed_time_factor=NAN),
     InvalidArgumentError, r"PlannerConfig\.compressed_time_factor"),
]


@pytest.mark.parametrize(("call", "error", "pattern"), _rows(BUDGET))
def test_budgets_planner_and_budgeted_step_refuse_bad_values(call, error, pattern):
    _check(call, error, pattern)


# -- the kernels' ops -----------------------------------------------------------------------------------

OPS = torch.ops.daftrain
X = torch.randn(1024)
CODES, LO, SCALE = OPS.quantize_pack(X, 2, 256, 0)

KERNELS: list[Case | object] = [
    pytest.param(lambda: OPS.quantize_pack(torch.arange(1024), 2, 256, 0), ArgumentTypeError, r"\bx\b.*int64",
                 id="quantize_pack(x int64)"),
    ("quantize_pack(x float64)", lambda: OPS.quantize_pack(X.double(), 2, 256, 0), ArgumentTypeError, r"float64"),
    ("quantize_pack(x complex64)", lambda: OPS.quantize_pack(X.to(torch.complex64), 2, 256, 0), ArgumentTypeError,
     r"complex64"),
    ("quantize_pack(bits=3)", lambda: OPS.quantize_pack(X, 3, 256, 0), LayoutError, r"^bits must be one of"),
    ("quantize_pack(bits=0)", lambda: OPS.quantize_pack(X, 0, 256, 0), LayoutError, r"^bits"),
    ("quantize_pack(group_size=33)", lambda: OPS.quantize_pack(X, 2, 33, 0), LayoutError, r"^group_size"),
    ("quantize_pack(group_size=0)", lambda: OPS.quantize_pack(X, 2, 0, 0), LayoutError, r"^group_size"),
    ("quantize_pack_seeded(seed float)", lambda: OPS.quantize_pack_seeded(X, 2, 256, torch.tensor(1.0)),
     InvalidArgumentError, r"^seed must be a 0-d int64"),
    ("quantize_pack_seeded(seed 1-d)", lambda: OPS.quantize_pack_seeded(X, 2, 256, torch.tensor([1])),
     InvalidArgumentError, r"^seed"),
    ("group_minmax(x int64)", lambda: OPS.group_minmax(torch.arange(1024), 256), ArgumentTypeError, r"int64"),
    ("group_minmax(group_size=33)", lambda: OPS.group_minmax(X, 33), LayoutError, r"^group_size"),
    ("unpack_dequantize(codes float32)", lambda: OPS.unpack_dequantize(CODES.float(), LO, SCALE, 2, 256, 1024,
                                                                       torch.float32),
     InvalidArgumentError, r"^codes must be uint8"),
    ("unpack_dequantize(codes too few groups)", lambda: OPS.unpack_dequantize(CODES[:2], LO, SCALE, 2, 256, 1024,
                                                                              torch.float32),
     InvalidArgumentError, r"^codes"),
    ("unpack_dequantize(bits disagree with codes)", lambda: OPS.unpack_dequantize(CODES, LO, SCALE, 4, 256, 1024,
                                                                                  torch.float32),
     InvalidArgumentError, r"^codes"),
    ("unpack_dequantize(bits=3)", lambda: OPS.unpack_dequantize(CODES, LO, SCALE, 3, 256, 1024, torch.float32),
     LayoutError, r"^bits"),
    ("unpack_dequantize(lo float16)", lambda: OPS.unpack_dequantize(CODES, LO.half(), SCALE, 2, 256, 1024,
                                                                    torch.float32),
     InvalidArgumentError, r"^lo must be float32"),
    ("unpack_dequantize(scale float32)", lambda: OPS.unpack_dequantize(CODES, LO, SCALE.float(), 2, 256, 1024,
                                                                       torch.float32),
     InvalidArgumentError, r"^scale must be bfloat16"),
    ("unpack_dequantize(numel=-1)", lambda: OPS.unpack_dequantize(CODES, LO, SCALE, 2, 256, -1, torch.float32),
     LayoutError, r"^numel"),
    pytest.param(lambda: OPS.unpack_dequantize(CODES, LO, SCALE, 2, 256, 1024, torch.int32), ArgumentTypeError,
                 r"\bdtype\b", id="unpack_dequantize(dtype int32)"),
    ("unpack_dequantize_into(out 2-D)", lambda: OPS.unpack_dequantize_into(torch.empty(32, 32), CODES, LO, SCALE, 2,
                                                                           256),
     InvalidArgumentError, r"^out must be a contiguous 1-D"),
    ("unpack_dequantize_into(out on meta)", lambda: OPS.unpack_dequantize_into(torch.empty(1024, device="meta"),
                                                                               CODES, LO, SCALE, 2, 256),
     InvalidArgumentError, r"^out .*on meta"),
    ("unpack_dequantize_into(out too small)", lambda: OPS.unpack_dequantize_into(torch.empty(10), CODES, LO, SCALE,
                                                                                 2, 256),
     InvalidArgumentError, r"^codes"),
    ("unpack_dequantize_into(out int32)", lambda: OPS.unpack_dequantize_into(torch.empty(1024, dtype=torch.int32),
                                                                             CODES, LO, SCALE, 2, 256),
     ArgumentTypeError, r"int32"),
    pytest.param(lambda: OPS.pack_bool(X), ArgumentTypeError, r"\bx\b.*float32", id="pack_bool(x float32)"),
    pytest.param(lambda: OPS.unpack_bool(torch.zeros(4, dtype=torch.uint8), -1), InvalidArgumentError,
                 r"\bnumel\b", id="unpack_bool(numel=-1)"),
    ("unpack_bool(packed too short)", lambda: OPS.unpack_bool(torch.zeros(4, dtype=torch.uint8), 1024),
     InvalidArgumentError, r"^packed must be uint8 \[128\]"),
    ("unpack_bool(packed float32)", lambda: OPS.unpack_bool(torch.zeros(128), 1024), InvalidArgumentError,
     r"^packed must be uint8"),
]


@pytest.mark.parametrize(("call", "error", "pattern"), _rows(KERNELS))
def test_kernel_ops_refuse_bad_arguments(call, error, pattern):
    _check(call, error, pattern)


@pytest.mark.parametrize("view", ["2-D", "transposed", "strided", "channels_last"])
def test_kernel_ops_read_any_layout_in_logical_order(view):
    """Not an error: the ops take tensors of any shape and stride and read them in logical order."""
    from daftrain.kernels import reference

    t = torch.randn(64, 64)
    x = {"2-D": t, "transposed": t.t(), "strided": t.view(-1)[::2],
         "channels_last": torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last)}[view]
    flat = x.contiguous().view(-1)
    for got, want in zip(OPS.quantize_pack(x, 2, 256, 7), reference.quantize_pack(flat, 2, 256, 7), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(OPS.group_minmax(x, 256), reference.group_minmax(flat, 256))
    assert torch.equal(OPS.pack_bool(x > 0), reference.pack_bool(flat > 0))
