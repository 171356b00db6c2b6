"""The custom ops through the dispatcher: round trips, unbiasedness, exact masks, bad input."""

import math

import pytest
import torch
from torch.library import opcheck

import daftrain  # noqa: F401  (registers the ops)

Q = torch.ops.daftrain


def _round_trip(x: torch.Tensor, bits: int, group_size: int = 256, seed: int = 0):
    codes, lo, scale = Q.quantize_pack(x, bits, group_size, seed)
    out = Q.unpack_dequantize(codes, lo, scale, bits, group_size, x.numel(), x.dtype)
    return out.view_as(x), lo, scale


def _per_value(t: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    return t.float().repeat_interleave(group_size)[:numel]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 255, 4096, 10_001])
def test_round_trip_error_is_within_one_step(bits, numel):
    torch.manual_seed(bits * 7 + numel)
    x = torch.randn(numel) * 3 + 0.5
    out, _, scale = _round_trip(x, bits)
    step = _per_value(scale.abs(), 256, numel)
    # One quantization step, plus float32 rounding of the decode (a few ulps of the group's range).
    tol = step * (1 + 1e-5) + 1e-6 * x.abs().max()
    assert ((out - x).abs() <= tol).all()
    # Decoded values stay inside the group's range, widened only by rounding the scale up to
    # bfloat16 (relative spacing 2**-7): the top level lo + L * scale overshoots max by < L * scale * 2**-7.
    levels = (1 << bits) - 1
    assert out.max() <= x.max() + levels * step.max() * 2**-7 + 1e-6


def test_eight_bits_is_exact_on_representable_values():
    # 256 values on a grid of step 2**-3 starting at -5: every value is a level of its group.
    levels = torch.arange(256, dtype=torch.float32)
    x = (levels[torch.randperm(256, generator=torch.Generator().manual_seed(0))] * 0.125 - 5.0).repeat(16)
    for seed in range(5):
        out, _, scale = _round_trip(x, 8, seed=seed)
        assert torch.equal(out, x)
        assert torch.equal(scale.float(), torch.full_like(scale.float(), 0.125))


# 1-bit zero-exact groups (ReLU-like data at bits=1) are documented as biased: test_one_bit_relu_groups.
@pytest.mark.parametrize(("bits", "relu"), [(b, False) for b in (1, 2, 4, 8)] + [(b, True) for b in (2, 4, 8)])
def test_dequantization_is_unbiased(bits, relu):
    torch.manual_seed(1)
    x = torch.randn(4096) * 2
    if relu:
        x = x.relu()
    draws = 400
    acc = torch.zeros(4096, dtype=torch.float64)
    for seed in range(draws):
        out, _, scale = _round_trip(x, bits, seed=seed * 7919 + 1)
        acc += out.double()
    mean = acc / draws
    # Stochastic rounding has variance p(1-p) step^2 <= step^2 / 4 per draw, so the mean of `draws`
    # independent draws has a standard deviation of at most step / (2 sqrt(draws)). With 4096 values a
    # 6-sigma bound fails by chance with probability ~1e-5.
    sigma = _per_value(scale.abs(), 256, 4096).double() / (2 * math.sqrt(draws))
    z = (mean - x.double()) / sigma.clamp_min(1e-30)
    z = torch.where(sigma > 0, z, (mean - x.double()) * 1e30)  # a zero step must reproduce x exactly
    assert z.abs().max() < 6, z.abs().max()
    # And no systematic drift: the average z-score of 4096 values is ~N(0, 1/64) at most.
    assert abs(z.mean().item()) < 6 / 64


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_relu_outputs_keep_an_exact_zero_mask(bits, dtype):
    torch.manual_seed(2)
    # Tiny positives next to exact zeros are the hard case: stochastic rounding on a plain grid would
    # send many of them to zero and change ReLU's gradient.
    x = (torch.randn(50_000) * torch.rand(50_000) ** 4).relu().to(dtype)
    for seed in range(3):
        out, _, _ = _round_trip(x, bits, seed=seed)
        assert torch.equal(out > 0, x > 0)
        assert torch.equal(out == 0, x == 0)


def test_one_bit_relu_groups():
    x = torch.tensor([0.0, 1.0, 3.0, 0.0] * 64)
    out, _, scale = _round_trip(x, 1)
    assert torch.equal(out > 0, x > 0)
    assert torch.signbit(scale).all()
    assert torch.equal(out[x > 0], torch.full_like(out[x > 0], 2.0))  # the midpoint of [1, 3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 8])
def test_half_precision_inputs(dtype, bits):
    torch.manual_seed(3)
    x = torch.randn(5000).to(dtype)
    out, _, scale = _round_trip(x, bits)
    assert out.dtype == dtype
    step = _per_value(scale.abs(), 256, 5000)
    half_ulp = x.float().abs() * 2.0**-8  # bfloat16 keeps 8 bits; float16 keeps 11
    assert ((out.float() - x.float()).abs() <= step + half_ulp + 1e-6).all()


def test_constant_and_zero_groups_are_exact():
    x = torch.cat([torch.zeros(256), torch.full((256,), 3.25), torch.full((256,), -7.0)])
    for bits in (1, 2, 4, 8):
        out, _, scale = _round_trip(x, bits)
        assert torch.equal(out, x)
        assert torch.equal(scale.float().abs(), torch.zeros(3))


def test_non_finite_values_show_in_group_params():
    x = torch.randn(1024)
    x[5], x[600], x[900] = float("nan"), float("inf"), -float("inf")
    _, lo, scale = Q.quantize_pack(x, 2, 256, 0)
    finite = torch.isfinite(lo) & torch.isfinite(scale.float())
    assert finite.tolist() == [False, True, False, False]
    # Finite values whose range overflows float32 also give a non-finite scale.
    big = torch.tensor([-3e38, 3e38] * 128)
    _, lo, scale = Q.quantize_pack(big, 2, 256, 0)
    assert not torch.isfinite(scale.float()).all()


def test_empty_tensor():
    codes, lo, scale = Q.quantize_pack(torch.empty(0), 2, 256, 0)
    assert codes.shape == (0, 64) and lo.shape == (0,)
    assert Q.unpack_dequantize(codes, lo, scale, 2, 256, 0, torch.float32).shape == (0,)


def test_bool_pack_round_trip():
    for n in (1, 7, 8, 9, 1000):
        m = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
        packed = Q.pack_bool(m)
        assert packed.shape == ((n + 7) // 8,)
        assert torch.equal(Q.unpack_bool(packed, n), m)
    assert Q.pack_bool(torch.tensor([True, False, True, True, False, False, False, True])).item() == 0b10001101


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.complex64, torch.bool])
def test_unsupported_dtypes_are_rejected(dtype):
    with pytest.raises(RuntimeError, match="quantizes float32, float16 and bfloat16"):
        Q.quantize_pack(torch.zeros(10, dtype=dtype), 2, 256, 0)


def test_bad_arguments_are_rejected():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="bits"):
        Q.quantize_pack(x, 3, 256, 0)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_pack(x, 2, 100, 0)
    codes, lo, scale = Q.quantize_pack(x, 2, 256, 0)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        Q.unpack_dequantize(codes, lo, scale, 4, 256, 100, torch.float32)
    with pytest.raises(RuntimeError, match="cannot dequantize"):
        Q.unpack_dequantize(codes, lo, scale, 2, 256, 100, torch.int32)
    with pytest.raises(RuntimeError, match="scale must be bfloat16"):
        Q.unpack_dequantize(codes, lo, scale.float(), 2, 256, 100, torch.float32)
    with pytest.raises(RuntimeError, match="pack_bool takes a bool"):
        Q.pack_bool(x)
    y = torch.randn(512 * 6)
    for cols in (0, 7, 24):  # no columns; 3072 values are not rows of 7; 128 rows of 24 make no group of 256 rows
        with pytest.raises(RuntimeError, match="cols must divide"):
            Q.quantize_pack_columns(y, cols, 2, 256, 0)
    codes, lo, scale = Q.quantize_pack_columns(y, 6, 2, 256, 0)
    with pytest.raises(RuntimeError, match="cols must divide"):
        Q.unpack_dequantize_columns_into(torch.empty(512 * 6), codes, lo, scale, 7, 2, 256)


def test_opcheck():
    x = torch.randn(1000)
    opcheck(Q.group_minmax.default, (x, 256))
    opcheck(Q.quantize_pack.default, (x, 2, 256, 5))
    opcheck(Q.quantize_pack_seeded.default, (x, 2, 256, torch.tensor(5)))
    codes, lo, scale = Q.quantize_pack(x, 2, 256, 5)
    opcheck(Q.unpack_dequantize.default, (codes, lo, scale, 2, 256, 1000, torch.float32))
    y = torch.randn(512 * 3)
    opcheck(Q.quantize_pack_columns.default, (y, 3, 2, 256, 5))
    opcheck(Q.unpack_dequantize_columns_into.default, (torch.empty(512 * 3), *Q.quantize_pack_columns(y, 3, 2, 256, 5),
                                                       3, 2, 256))
    opcheck(Q.unpack_dequantize_into.default, (torch.empty(1000), codes, lo, scale, 2, 256))
    m = x > 0
    opcheck(Q.pack_bool.default, (m,))
    opcheck(Q.unpack_bool.default, (Q.pack_bool(m), 1000))


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_quantize_pack_seeded_writes_the_bytes_of_quantize_pack(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor-seeded variant (compiled graphs draw its seed) is byte-identical to ``quantize_pack`` with
    ``int(seed)``, seeds past 32 bits included (both use the low 32 bits), with each kernel; a bad seed raises."""
    from daftrain.kernels import registry

    if backend == "reference":
        monkeypatch.setattr(registry._status, "cpu", "reference")
    x = torch.randn(10_001) * 3
    for bits in (1, 2, 4, 8):
        for seed in (0, 12345, (1 << 32) + 7, (1 << 62) + 3):
            expected = Q.quantize_pack(x, bits, 256, seed)
            got = Q.quantize_pack_seeded(x, bits, 256, torch.tensor(seed))
            assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), (bits, seed)
    with pytest.raises(RuntimeError, match="seed must be a 0-d int64 CPU tensor"):
        Q.quantize_pack_seeded(x, 2, 256, torch.tensor([1, 2]))


def test_unpack_into_bumps_the_version_of_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op writes ``out``: its version counter moves, with the fast kernel and with the reference (so an
    autograd graph that saved ``out`` sees the write), and a tensor saved before the write is refused."""
    from daftrain.kernels import registry

    x = torch.randn(1000)
    codes, lo, scale = Q.quantize_pack(x, 2, 256, 5)
    for backend in ("fast", "reference"):
        if backend == "reference":
            monkeypatch.setattr(registry._status, "cpu", "reference")
        out = torch.zeros(1000)
        before = out._version
        Q.unpack_dequantize_into(out, codes, lo, scale, 2, 256)
        assert out._version > before, backend
        w = torch.ones(1000, requires_grad=True)
        y = (w * out).sum()  # saves out
        Q.unpack_dequantize_into(out, codes, lo, scale, 2, 256)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_the_op_table_is_what_every_backend_registers():
    """``ops.OPS`` is the one list of ops: the registry registers a CPU kernel for each (the ops reach
    numba, not the reference), and the CPU backend offers exactly these."""
    from daftrain.kernels import cpu, ops, registry
    from daftrain.kernels.reduction import ReductionSelector

    assert set(ops.OPS) == {"group_minmax", "quantize_pack", "quantize_pack_seeded", "unpack_dequantize",
                            "unpack_dequantize_into", "quantize_pack_columns", "unpack_dequantize_columns_into",
                            "pack_bool", "unpack_bool"}
    assert registry.load_fast_kernels().cpu == "numba"
    assert set(cpu.make_kernels(ReductionSelector("cpu", cpu.STRATEGIES))) == set(ops.OPS)
    for name, op in ops.OPS.items():
        assert op is getattr(ops, name) and op.name == name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"daftrain::{name}", "CPU"), name


def _count(monkeypatch, cls, method):  # type: ignore[no-untyped-def]
    calls = []
    original = getattr(cls, method)

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, method, counting)
    return calls


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_arguments_are_checked_once_per_call(monkeypatch, backend):
    """The op's check runs once per call at the op boundary, and the kernels do not validate again
    (one ``PackedLayout`` check per call, where the numba wrappers used to make their own)."""
    from daftrain.kernels import ops, registry
    from daftrain.layout import PackedLayout

    registry.load_fast_kernels()
    if backend == "reference":
        monkeypatch.setattr(registry._status, "cpu", "reference")
    x = torch.randn(1000)
    codes, lo, scale = Q.quantize_pack(x, 2, 256, 5)
    out = torch.empty(1000)
    checks = {name: _count(monkeypatch, op, "check") for name, op in ops.OPS.items()}
    for name, call in {
        "quantize_pack": lambda: Q.quantize_pack(x, 2, 256, 5),
        "group_minmax": lambda: Q.group_minmax(x, 256),
        "unpack_dequantize_into": lambda: Q.unpack_dequantize_into(out, codes, lo, scale, 2, 256),
    }.items():
        layouts = _count(monkeypatch, PackedLayout, "__post_init__")
        call()
        assert len(checks[name]) == 1, name
        if backend == "fast":
            assert len(layouts) == 1, (name, len(layouts))
        checks[name].clear()


def test_argument_errors_derive_from_daftrain_errors():
    from daftrain.errors import ArgumentTypeError, DaftrainError, InvalidArgumentError

    x = torch.randn(100)
    codes, lo, scale = Q.quantize_pack(x, 2, 256, 0)
    with pytest.raises(ArgumentTypeError, match="quantizes float32"):
        Q.quantize_pack(x.double(), 2, 256, 0)
    with pytest.raises(InvalidArgumentError, match="codes must be uint8"):
        Q.unpack_dequantize(codes, lo, scale, 4, 256, 100, torch.float32)
    with pytest.raises(InvalidArgumentError, match="contiguous 1-D"):
        Q.unpack_dequantize_into(torch.empty(100, 2)[:, 0], codes, lo, scale, 2, 256)
    with pytest.raises(InvalidArgumentError, match="packed must be"):
        Q.unpack_bool(torch.zeros(3, dtype=torch.uint8), 100)
    with pytest.raises(DaftrainError, match="bool tensor"):
        Q.pack_bool(x)
    with pytest.raises(DaftrainError, match="group_size"):
        Q.group_minmax(x, 48)


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_eager_calls_run_the_kernel_the_dispatcher_would(monkeypatch, backend):
    """``NOTE [ Eager calls skip the dispatcher ]``: an ``Op`` called on a plain tensor runs the device's
    checked kernel directly (the same bytes as through the dispatcher, the same argument check, the
    version of what it writes bumped); under a dispatch mode or on a fake tensor it goes through the
    dispatcher, which the mode sees."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from daftrain.kernels import ops, registry

    registry.load_fast_kernels()
    if backend == "reference":
        monkeypatch.setattr(registry._status, "cpu", "reference")
    direct: list[int] = []
    kernel = ops.quantize_pack.eager_kernels["cpu"]

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        direct.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setitem(ops.quantize_pack.eager_kernels, "cpu", counted)
    x = torch.randn(1000) * 3
    grid = torch.tensor([0.0, 1.25, 2.0, 3.0])
    for g in (None, grid):
        got, expected = ops.quantize_pack(x, 2, 256, 5, g), Q.quantize_pack(x, 2, 256, 5, g)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert len(direct) == 2
    with pytest.raises(ValueError, match="bits"):
        ops.quantize_pack(x, 3, 256, 0)
    codes, lo, scale = got
    out = torch.zeros(1000)
    before = out._version
    ops.unpack_dequantize_into(out, codes, lo, scale, 2, 256, grid)
    assert out._version > before
    assert torch.equal(out, Q.unpack_dequantize(codes, lo, scale, 2, 256, 1000, torch.float32, grid))

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    direct.clear()
    with Seen() as seen:
        ops.quantize_pack(x, 2, 256, 5)
    assert "daftrain.quantize_pack.default" in seen.ops and not direct
    with FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(x)
        fake_codes, fake_lo, _ = ops.quantize_pack(fake, 2, 256, 5)
    assert tuple(fake_codes.shape) == tuple(codes.shape) and fake_lo.dtype == torch.float32 and not direct


def test_an_op_called_with_keywords_only_goes_through_the_dispatcher():
    from daftrain.kernels import ops

    x = torch.randn(1000)
    got = ops.quantize_pack(x=x, bits=2, group_size=256, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(got, Q.quantize_pack(x, 2, 256, 5), strict=True))
