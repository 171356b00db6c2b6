"""The numba CPU kernels are byte-identical to the reference (``daftrain.kernels.reference``).

Every comparison is on bytes (``.view`` as integers), so NaN payloads, -0.0 and the scale's sign bit
(the zero-exact flag) all count. The reference functions are called directly; the fast kernels both
directly and through the registered ``torch.ops.daftrain`` ops.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numba
import pytest
import torch

from daftrain.kernels import (
    cpu,
    ops,
    reference,
    registry,
)

INF, NAN = math.inf, math.nan
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (1, 2, 4, 8)
GROUPS = (32, 256, 4096)


@pytest.fixture(scope="module", autouse=True)
def fast_kernels() -> None:
    status = registry.load_fast_kernels()
    assert status.cpu == "numba", status


def as_int(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor as integers of the same width (NaN-safe, -0.0-aware comparison)."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ia, ib = as_int(a), as_int(b)
    if not torch.equal(ia, ib):
        bad = (ia != ib).nonzero()[:5].tolist()
        pytest.fail(f"{what} differs at {bad}: fast {ia[ia != ib][:5].tolist()} reference {ib[ia != ib][:5].tolist()}")


def check_quantize(x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None) -> None:
    """Fast quantize_pack (both schedules) and unpack_dequantize against the reference, byte for byte."""
    ref = reference.quantize_pack(x, bits, group_size, seed, grid)
    what = f"bits={bits}, G={group_size}, {x.dtype}, n={x.numel()}, grid={grid is not None}"
    for strategy in (cpu.PER_GROUP, cpu.TWO_LEVEL):
        got = cpu.quantize_pack_with(strategy, x, bits, group_size, seed, grid)
        for name, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
            assert_same(a, b, f"{name} ({strategy}, {what})")
    codes, lo, scale = ref
    dec = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, group_size, x.numel(), x.dtype, grid)
    ref_dec = reference.unpack_dequantize(codes, lo, scale, bits, group_size, x.numel(), x.dtype, grid)
    assert_same(dec, ref_dec, f"decoded ({what})")
    into = torch.full((x.numel(),), float("nan"), dtype=x.dtype)  # every value must be overwritten
    torch.ops.daftrain.unpack_dequantize_into(into, codes, lo, scale, bits, group_size, grid)
    assert_same(into, ref_dec, f"decoded into ({what})")


def special_inputs(group_size: int) -> dict[str, torch.Tensor]:
    """Float32 inputs exercising every branch of group_params and of the NaN rules."""
    gen = torch.Generator().manual_seed(1)
    G = group_size

    def randn(k: int) -> torch.Tensor:
        return torch.randn(k, generator=gen)

    cases: dict[str, torch.Tensor] = {}
    cases["all_zero"] = torch.zeros(2 * G + 3)
    cases["all_neg_zero"] = torch.full((G + 5,), -0.0)
    cases["constant"] = torch.full((2 * G + 1,), 3.25)
    cases["neg_constant"] = torch.full((G,), -7.5)
    cases["relu"] = torch.relu(randn(3 * G + 7))
    x = torch.relu(randn(4 * G))
    x[:G] = 0
    cases["relu_zero_group"] = x
    cases["sparse"] = torch.where(randn(2 * G).abs() < 0.5, torch.zeros(2 * G), randn(2 * G))
    cases["huge_pm"] = torch.where(randn(2 * G + 1) > 0, 3e38, -3e38)
    cases["huge_random"] = randn(2 * G + 1) * 3e38
    x = torch.relu(randn(2 * G)) * 3e38
    x[1] = 1e-30
    cases["relu_huge"] = x
    x = randn(3 * G + 2)
    x[5], x[G + 3], x[2 * G + 1] = NAN, INF, -INF
    cases["nan_inf"] = x
    cases["all_inf"] = torch.full((G + 1,), INF)
    cases["all_neg_inf"] = torch.full((G + 1,), -INF)
    cases["all_nan"] = torch.full((G,), NAN)
    x = randn(G)
    x[::7] = -NAN
    cases["neg_nan"] = x
    cases["neg_inf_to_inf"] = torch.cat([torch.full((G // 2,), -INF), torch.full((G // 2,), INF)])
    x = torch.zeros(G)
    x[3] = INF
    cases["zero_and_inf"] = x  # zero-exact with min positive = +inf: (inf - inf) scale
    x[4] = 2.0
    cases["zero_inf_finite"] = x.clone()
    x = torch.relu(randn(G))
    x[0] = INF
    cases["relu_inf"] = x
    cases["subnormal"] = randn(2 * G) * 1e-40
    cases["subnormal_relu"] = torch.relu(randn(2 * G)) * 1e-39  # 1 / step overflows to inf
    cases["min_subnormal"] = torch.full((G,), 1e-45)
    cases["one_ulp_range"] = torch.tensor([1.0, 1.0 + 2**-23] * G)
    cases["fp16_overflow"] = randn(2 * G) * 7e4  # decodes past float16's range
    return cases


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUPS)
def test_random_all_bits(dtype: torch.dtype, group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    for n in (0, 1, 31, group_size, 3 * group_size + 17):
        x = (torch.randn(n, generator=gen) * 3 + 1).to(dtype)
        assert_same(cpu.minmax_per_group(x, group_size), reference.group_minmax(x, group_size), "stats")
        assert_same(cpu.minmax_two_level(x, group_size), reference.group_minmax(x, group_size), "stats 2-level")
        for bits in BITS:
            check_quantize(x, bits, group_size, seed=n * 7 + bits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", (32, 256))
def test_special_values(dtype: torch.dtype, group_size: int) -> None:
    for name, x in special_inputs(group_size).items():
        x = x.to(dtype)
        assert_same(cpu.minmax_per_group(x, group_size), reference.group_minmax(x, group_size), f"stats {name}")
        for bits in BITS:
            check_quantize(x, bits, group_size, seed=12345)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_every_16_bit_pattern(dtype: torch.dtype) -> None:
    """All 65536 float16 / bfloat16 patterns (NaNs, infs, subnormals, both zeros) as input."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    assert_same(cpu.minmax_per_group(x, 256), reference.group_minmax(x, 256), "stats")
    for bits in (2, 8):
        check_quantize(x, bits, 256, seed=3)
    for bits in (2, 4):  # the fitted grid's kernels widen and narrow the same 16-bit values
        check_quantize(x, bits, 256, seed=5, grid=fitted_grid(bits, bits))


def test_sorted_patterns_and_huge_group() -> None:
    """float32 patterns in order (so groups hold ranges of magnitudes), G = 65536 and G = 32."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-(2**31), 2**31, (70000,), dtype=torch.int64, generator=gen).to(torch.int32)
    x = x.sort().values.view(torch.float32)
    for group_size in (32, 65536):
        for bits in (1, 4):
            check_quantize(x, bits, group_size, seed=1)


@pytest.mark.parametrize("bits", BITS)
def test_decode_any_bytes(bits: int) -> None:
    """Decoding arbitrary lo / scale / codes bytes (NaN payloads, infs, both signs) matches too."""
    gen = torch.Generator().manual_seed(bits)
    ng, G = 600, 32
    lo = torch.randint(-(2**31), 2**31, (ng,), dtype=torch.int64, generator=gen).to(torch.int32)
    specials = torch.tensor(
        [0x7F800000, -0x00800000, 0x7FC00000, -0x00400000, 0x7F800001, 0, -(2**31), 0x3F800000], dtype=torch.int32
    )
    pick = torch.randint(0, 8, (ng,), generator=gen)
    lo = torch.where(torch.randint(0, 2, (ng,), generator=gen) == 0, specials[pick], lo)
    scale = torch.randint(-(2**15), 2**15, (ng,), dtype=torch.int64, generator=gen).to(torch.int16)
    sspec = torch.tensor([0x7F80, -0x80, 0x7FC0, -0x40, 0x7F81, 0, -(2**15), 0x3F80, 1, -0x7FFF], dtype=torch.int16)
    pick = torch.randint(0, 10, (ng,), generator=gen)
    scale = torch.where(torch.randint(0, 2, (ng,), generator=gen) == 0, sspec[pick], scale)
    codes = torch.randint(0, 256, (ng, G * bits // 8), dtype=torch.uint8, generator=gen)
    for dtype in DTYPES:
        args = (codes, lo.view(torch.float32), scale.view(torch.bfloat16), bits, G, ng * G - 5, dtype)
        assert_same(cpu.unpack_dequantize(*args), reference.unpack_dequantize(*args), f"decode {dtype}")


def test_seed_and_index_hash() -> None:
    """Seeds past 32 bits and negative ones are taken mod 2**32, as the reference does (groups of 32 take
    the scalar path at 2 bits, groups of 256 the explicit vectors)."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    for seed in (0, 1, 2**32 - 1, 2**32 + 5, 2**63 - 1, -1, -(2**40)):
        for group_size in (32, 256):
            check_quantize(x, 2, group_size, seed)


@pytest.mark.parametrize("group_size", (96, 160, 224))
def test_vector_runs_then_scalar_rest(group_size: int) -> None:
    """float32 groups that are not a whole number of explicit-vector runs (``128 / bits`` values): runs,
    then the scalar path for the rest of each group, for plain and zero-exact (ReLU) groups."""
    gen = torch.Generator().manual_seed(group_size)
    x = torch.randn(5 * group_size + 40, generator=gen)
    for values in (x, torch.relu(x)):
        for bits in BITS:
            check_quantize(values, bits, group_size, seed=bits)


def test_non_contiguous_and_shapes() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(64, 100, generator=gen)
    for x in (base.t(), base[:, ::3], base[::2], base.view(8, 8, 100).permute(2, 0, 1)):
        assert not x.is_contiguous()
        for dtype in DTYPES:
            check_quantize(x.to(dtype), 4, 256, seed=9)
            got = torch.ops.daftrain.quantize_pack(x.to(dtype), 4, 256, 9)
            ref = reference.quantize_pack(x.to(dtype), 4, 256, 9)
            for a, b in zip(got, ref, strict=True):
                assert_same(a, b, "op on non-contiguous")


def test_zero_size_and_one() -> None:
    for dtype in DTYPES:
        for n in (0, 1):
            x = torch.full((n,), -2.5, dtype=dtype)
            for bits in BITS:
                got = torch.ops.daftrain.quantize_pack(x, bits, 32, 0)
                ref = reference.quantize_pack(x, bits, 32, 0)
                for a, b in zip(got, ref, strict=True):
                    assert_same(a, b, f"n={n}")
                out = torch.ops.daftrain.unpack_dequantize(*got, bits, 32, n, dtype)
                assert_same(out, reference.unpack_dequantize(*ref, bits, 32, n, dtype), f"decode n={n}")
            assert_same(torch.ops.daftrain.group_minmax(x, 32), reference.group_minmax(x, 32), "stats")
    assert torch.ops.daftrain.pack_bool(torch.zeros(0, dtype=torch.bool)).numel() == 0
    assert torch.ops.daftrain.unpack_bool(torch.zeros(0, dtype=torch.uint8), 0).numel() == 0


@pytest.mark.parametrize("n", (0, 1, 7, 8, 9, 1000, 70001))
def test_pack_bool(n: int) -> None:
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.3
    packed = torch.ops.daftrain.pack_bool(x)
    assert_same(packed, reference.pack_bool(x), "pack_bool")
    assert_same(torch.ops.daftrain.unpack_bool(packed, n), reference.unpack_bool(packed, n), "unpack_bool")
    if n > 8:  # non-contiguous bool input
        y = torch.stack([x, ~x], 1).t()
        assert_same(torch.ops.daftrain.pack_bool(y), reference.pack_bool(y), "pack_bool view")


def test_ops_use_the_fast_kernels() -> None:
    """The registered ops reach the numba kernels (the same bytes, and quicker than the reference)."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(6))
    got = torch.ops.daftrain.quantize_pack(x, 2, 256, 5)
    for a, b in zip(got, reference.quantize_pack(x, 2, 256, 5), strict=True):
        assert_same(a, b, "op")
    stats = torch.ops.daftrain.group_minmax(x, 256)
    assert_same(stats, reference.group_minmax(x, 256), "op stats")
    out = torch.ops.daftrain.unpack_dequantize(*got, 2, 256, x.numel(), torch.bfloat16)
    assert_same(out, reference.unpack_dequantize(*got, 2, 256, x.numel(), torch.bfloat16), "op decode")
    by_name = ops.quantize_pack(x, bits=2, group_size=256, seed=5)  # keyword arguments reach the kernel too
    for a, b in zip(by_name, got, strict=True):
        assert_same(a, b, "op with keywords")


def test_ops_do_not_run_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the numba kernels registered, the ops never call the reference on CPU."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reference ran")

    for name in ("group_minmax", "quantize_pack", "unpack_dequantize", "unpack_dequantize_into", "pack_bool",
                 "unpack_bool"):
        monkeypatch.setattr(reference, name, forbidden)
    x = torch.randn(4096)
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, 4, 256, 1)
    torch.ops.daftrain.group_minmax(x, 256)
    torch.ops.daftrain.unpack_dequantize(codes, lo, scale, 4, 256, x.numel(), torch.float32)
    torch.ops.daftrain.unpack_dequantize_into(torch.empty(x.numel()), codes, lo, scale, 4, 256)
    torch.ops.daftrain.unpack_bool(torch.ops.daftrain.pack_bool(x > 0), x.numel())


def test_ops_validate_before_the_kernel_runs() -> None:
    """A registered kernel replaces the op's Python body: the argument checks still happen (the fast
    kernels do no bounds checks, so a bad size must never reach them)."""
    x = torch.randn(100)
    with pytest.raises(ValueError, match="bits"):
        torch.ops.daftrain.quantize_pack(x, 3, 32, 0)
    with pytest.raises(ValueError, match="group_size"):
        torch.ops.daftrain.group_minmax(x, 48)
    with pytest.raises(RuntimeError, match="float32, float16 and bfloat16"):
        torch.ops.daftrain.quantize_pack(x.int(), 2, 32, 0)
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, 2, 32, 0)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.daftrain.unpack_dequantize(codes[:2], lo, scale, 2, 32, 100, torch.float32)
    with pytest.raises(RuntimeError, match="lo must be"):
        torch.ops.daftrain.unpack_dequantize(codes, lo.double(), scale, 2, 32, 100, torch.float32)
    with pytest.raises(RuntimeError, match="cannot dequantize"):
        torch.ops.daftrain.unpack_dequantize(codes, lo, scale, 2, 32, 100, torch.int32)
    with pytest.raises(RuntimeError, match="codes must be"):  # 1000 values need more groups than 4
        torch.ops.daftrain.unpack_dequantize_into(torch.empty(1000), codes, lo, scale, 2, 32)
    with pytest.raises(RuntimeError, match="contiguous 1-D"):
        torch.ops.daftrain.unpack_dequantize_into(torch.empty(100, 2)[:, 0], codes, lo, scale, 2, 32)
    with pytest.raises(RuntimeError, match="cannot dequantize"):
        torch.ops.daftrain.unpack_dequantize_into(torch.empty(100, dtype=torch.float64), codes, lo, scale, 2, 32)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.daftrain.unpack_bool(torch.zeros(3, dtype=torch.uint8), 100)
    with pytest.raises(RuntimeError, match="bool tensor"):
        torch.ops.daftrain.pack_bool(x)


def test_thread_count_does_not_matter() -> None:
    x = torch.randn(50000, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in sorted({1, max(1, numba.config.NUMBA_NUM_THREADS)}):
            torch.set_num_threads(threads)
            results.append(
                [cpu.quantize_pack_with(s, x, 4, 4096, 1) for s in (cpu.PER_GROUP, cpu.TWO_LEVEL)]
            )
    finally:
        torch.set_num_threads(before)
    first = results[0][0]
    for per_thread in results:
        for got in per_thread:
            for a, b in zip(got, first, strict=True):
                assert_same(a, b, "threads / strategy")


def test_opcheck() -> None:
    x = torch.randn(3, 100)
    torch.library.opcheck(torch.ops.daftrain.group_minmax.default, (x, 32))
    torch.library.opcheck(torch.ops.daftrain.quantize_pack.default, (x, 2, 32, 7))
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, 2, 32, 7)
    torch.library.opcheck(torch.ops.daftrain.unpack_dequantize.default, (codes, lo, scale, 2, 32, 300, torch.float16))
    out = torch.empty(300, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.daftrain.unpack_dequantize_into.default, (out, codes, lo, scale, 2, 32))
    grid = torch.tensor([0.0, 1.25, 2.0, 3.0])
    torch.library.opcheck(torch.ops.daftrain.quantize_pack.default, (x, 2, 32, 7, grid))
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, 2, 32, 7, grid)
    torch.library.opcheck(torch.ops.daftrain.unpack_dequantize.default,
                          (codes, lo, scale, 2, 32, 300, torch.float32, grid))
    torch.library.opcheck(torch.ops.daftrain.unpack_dequantize_into.default, (out, codes, lo, scale, 2, 32, grid))
    y = torch.randn(64, 10)
    torch.library.opcheck(torch.ops.daftrain.quantize_pack_columns.default, (y, 10, 2, 32, 7, grid))
    codes, lo, scale = torch.ops.daftrain.quantize_pack_columns(y, 10, 2, 32, 7, grid)
    torch.library.opcheck(torch.ops.daftrain.unpack_dequantize_columns_into.default,
                          (torch.empty(640), codes, lo, scale, 10, 2, 32, grid))
    b = x > 0
    torch.library.opcheck(torch.ops.daftrain.pack_bool.default, (b,))
    torch.library.opcheck(torch.ops.daftrain.unpack_bool.default, (torch.ops.daftrain.pack_bool(b), 300))


# ---------------------------------------------------------------------------------------------
# The one place where the reference is not a function of its input
# ---------------------------------------------------------------------------------------------


def test_signed_zero_tie() -> None:
    """A group whose min or max is a zero of both signs: the spec settles it by IEEE 754's total
    order (min -0.0, max +0.0), so the bytes do not depend on a vectorised loop's lane layout."""
    x = torch.zeros(64)
    x[1::2] = -0.0  # both signs in each group of 32
    x[40] = 1.0  # second group: max 1.0, min -0.0 -> zero-exact
    for stats in (cpu.minmax_per_group(x, 32), cpu.minmax_two_level(x, 32), reference.group_minmax(x, 32)):
        assert torch.signbit(stats[:, 0]).all()
        assert not torch.signbit(stats[0, 1]) and stats[1, 1] == 1.0
    got = cpu.quantize_pack_with(cpu.PER_GROUP, x, 2, 32, 0)
    ref = reference.quantize_pack(x, 2, 32, 0)
    for a, b in zip(got, ref, strict=True):
        assert_same(a, b, "tie")
    assert torch.signbit(got[1][0])  # lo of the all-zero group is the min, -0.0
    for dtype in DTYPES:
        dec = cpu.unpack_dequantize(*got, 2, 32, 64, dtype)
        assert_same(dec, reference.unpack_dequantize(*ref, 2, 32, 64, dtype), "decoded")


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_kernel_report() -> None:
    report = registry.kernel_report()
    assert report["status"]["cpu"] == "numba"
    assert report["numba"]["version"] == numba.__version__
    assert "cpu" in report["reduction"]
    import json

    json.dumps(report)


def test_disable_env(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = registry._status
    monkeypatch.setattr(registry, "_status", None)
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            status = registry.load_fast_kernels()
        assert status.disabled and status.cpu == "disabled"
    finally:
        registry._status = saved


def test_import_failure_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = registry._status
    monkeypatch.setattr(registry, "_status", None)
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)

    def broken(selector):  # type: ignore[no-untyped-def]
        raise ImportError("simulated: numba is broken")

    monkeypatch.setattr(cpu, "make_kernels", broken)
    try:
        with pytest.warns(RuntimeWarning, match="numba is broken.*reference kernels run instead") as caught:
            status = registry.load_fast_kernels()
        assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
        assert status.cpu == "reference" and "numba is broken" in status.errors["cpu"]
    finally:
        registry._status = saved


def test_compile_failure_at_run_time_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from numba.core.errors import TypingError

    monkeypatch.setattr(registry, "_status", registry.KernelStatus(cpu="numba"))

    def broken(x, group_size):  # type: ignore[no-untyped-def]
        raise TypingError("simulated compile failure")

    kernel = registry._guarded(registry.CPU, ops.group_minmax, broken)
    x = torch.randn(100)
    with pytest.warns(RuntimeWarning, match="failed to compile.*reference"):
        out = kernel(x, 32)
    assert_same(out, reference.group_minmax(x, 32), "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel(x, 32)  # no second warning: the reference runs from now on
    assert registry._status.cpu == "reference"


def test_torch_thread_count_survives_numba_pool_start() -> None:
    """numba's OpenMP pool, started by the first parallel kernel, calls omp_set_num_threads in the
    process's libgomp; PyTorch's setting must come out unchanged (fresh process: the pool starts there)."""

    # No PyTorch op with a parallel region runs before the pool starts (torch.randn would start
    # libgomp's own team first and hide the reset): constructing ``compress`` starts it.
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "import daftrain\n"
        "from daftrain.kernels import cpu\n"
        "daftrain.compress(bits=2)\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n"
        "assert cpu.threads() == 1\n"
    )
    src = str(Path(cpu.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("offset", (0, 1))
def test_streaming_decode(offset: int) -> None:
    """A float32 output of at least ``STREAMING_BYTES`` is written with non-temporal stores when it is
    64-byte aligned (``offset`` 0), with cached stores otherwise (``offset`` 1: 4 bytes past alignment);
    both byte-identical to the reference, plain and zero-exact groups."""
    n = cpu.STREAMING_BYTES // 4 + 1000
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=gen)
    x[: n // 2] = torch.relu(x[: n // 2])
    for bits in (1, 2, 4, 8):
        codes, lo, scale = reference.quantize_pack(x, bits, 256, bits)
        out = torch.full((n + 16,), float("nan"))[offset : offset + n]
        assert (out.data_ptr() % 64 == 0) == (offset == 0)
        assert cpu.streams(out) == (offset == 0)
        torch.ops.daftrain.unpack_dequantize_into(out, codes, lo, scale, bits, 256)
        assert_same(out, reference.unpack_dequantize(codes, lo, scale, bits, 256, n, torch.float32),
                    f"streaming decode (bits={bits}, offset={offset})")


def column_inputs(group_size: int, cols: int) -> dict[str, torch.Tensor]:
    """``[2 * group_size, cols]`` inputs for the column kernels: every special input wrapped over the rows (so its
    special values land in some columns' groups), and whole columns that are zero, ReLU-like, NaN or infinite."""
    n = 2 * group_size * cols
    cases = {name: x.repeat(-(-n // x.numel()))[:n].view(-1, cols) for name, x in special_inputs(group_size).items()}
    x = torch.randn(2 * group_size, cols, generator=torch.Generator().manual_seed(5)) * 3
    x[:, 0] = 0
    x[:, 1 % cols] = x[:, 1 % cols].relu()
    x[: group_size, 2 % cols] = NAN
    x[group_size:, cols - 1] = INF
    cases["column_modes"] = x
    return cases


def check_columns(x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None,
                  name: str = "") -> None:
    """Fast quantize_pack_columns / unpack_dequantize_columns_into against the reference's reordering around
    the pure row reference, byte for byte."""
    cols = x.shape[1]
    ref = reference.quantize_pack(reference.columns_first(x, cols, group_size), bits, group_size, seed, grid)
    got = torch.ops.daftrain.quantize_pack_columns(x.reshape(-1), cols, bits, group_size, seed, grid)
    what = f"{name} bits={bits}, G={group_size}, cols={cols}, {x.dtype}, grid={grid is not None}"
    for name, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
        assert_same(a, b, f"{name} by columns ({what})")
    for dtype in DTYPES:
        decoded = reference.unpack_dequantize(*ref, bits, group_size, x.numel(), dtype, grid)
        want = decoded.view(-1, cols, group_size).transpose(1, 2).reshape(-1)
        into = torch.full((x.numel(),), NAN, dtype=dtype)  # every value must be overwritten
        torch.ops.daftrain.unpack_dequantize_columns_into(into, *ref, cols, bits, group_size, grid)
        assert_same(into, want, f"decoded by columns into {dtype} ({what})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size, cols", [(32, 1), (32, 7), (96, 40), (256, 64), (256, 100)])
def test_column_kernels(dtype: torch.dtype, group_size: int, cols: int) -> None:
    for k, (name, x) in enumerate(column_inputs(group_size, cols).items()):
        for bits in BITS:
            check_columns(x.to(dtype), bits, group_size, 3 + k, None, name)
        for bits in (2, 4):
            check_columns(x.to(dtype), bits, group_size, 3 + k, fitted_grid(bits, k), name)


def test_column_kernels_on_a_large_tensor_use_every_thread() -> None:
    x = torch.randn(4096, 384, generator=torch.Generator().manual_seed(2))
    x[:, 5] *= 40
    for bits in BITS:
        check_columns(x, bits, 256, 9, None)
    check_columns(x, 4, 256, 9, fitted_grid(4, 1))


def fitted_grid(bits: int, seed: int) -> torch.Tensor:
    """A random ascending grid from 0 to 2**bits - 1 (``layout.py``)."""
    levels = (1 << bits) - 1
    inner = torch.rand(levels - 1, generator=torch.Generator().manual_seed(seed)).sort().values * levels
    return torch.cat([torch.zeros(1), inner, torch.tensor([float(levels)])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (2, 4))
def test_fitted_grid(dtype: torch.dtype, bits: int) -> None:
    cases = {**special_inputs(32), "random": torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 4}
    for k, (name, x) in enumerate(cases.items()):
        x, grid = x.to(dtype), fitted_grid(bits, k)
        ref = reference.quantize_pack(x, bits, 32, 11 + k, grid)
        for strategy in (cpu.PER_GROUP, cpu.TWO_LEVEL):
            got = cpu.quantize_pack_with(strategy, x, bits, 32, 11 + k, grid)
            for part, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
                assert_same(a, b, f"{part} on a grid ({name}, {strategy}, bits={bits}, {dtype})")
        want = reference.unpack_dequantize(*ref, bits, 32, x.numel(), dtype, grid)
        assert_same(torch.ops.daftrain.unpack_dequantize(*ref, bits, 32, x.numel(), dtype, grid), want,
                    f"decoded on a grid ({name}, bits={bits}, {dtype})")
        into = torch.full((x.numel(),), float("nan"), dtype=dtype)
        torch.ops.daftrain.unpack_dequantize_into(into, *ref, bits, 32, grid)
        assert_same(into, want, f"decoded into on a grid ({name}, bits={bits}, {dtype})")


def test_uniform_grid_is_no_grid() -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(8)) * 2
    for bits in (2, 4):
        uniform = torch.arange(float(1 << bits))
        plain = torch.ops.daftrain.quantize_pack(x, bits, 256, 4)
        # the reference's arithmetic on the uniform grid is its arithmetic without one ...
        for a, b in zip(reference.quantize_pack(x, bits, 256, 4, uniform), plain, strict=True):
            assert_same(a, b, f"reference on the uniform grid, bits={bits}")
        # ... so the kernels run a uniform grid as no grid, and the column kernels (which take it) agree
        assert cpu._fitted(uniform) is None and cpu._fitted(fitted_grid(bits, 0)) is not None
        for a, b in zip(torch.ops.daftrain.quantize_pack(x, bits, 256, 4, uniform), plain, strict=True):
            assert_same(a, b, f"uniform grid, bits={bits}")
        columns = reference.columns_first(x[:2560], 10, 256)
        for a, b in zip(torch.ops.daftrain.quantize_pack_columns(x[:2560], 10, bits, 256, 4, uniform),
                        torch.ops.daftrain.quantize_pack(columns, bits, 256, 4), strict=True):
            assert_same(a, b, f"uniform grid down the columns, bits={bits}")
        other = torch.ops.daftrain.quantize_pack(x, bits, 256, 4, fitted_grid(bits, 0))
        assert not torch.equal(other[0], plain[0])  # a fitted grid does change the codes


@pytest.mark.parametrize("grid, bits, match", [
    (torch.tensor([0.0, 2.0, 1.0, 3.0]), 2, "ascend"),
    (torch.tensor([0.0, 1.0, 2.0, 3.5]), 2, "ascend"),
    (torch.tensor([0.0, float("nan"), 2.0, 3.0]), 2, "ascend"),
    (torch.tensor([0.0, 1.0, 3.0]), 2, "float32 \\[4\\]"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64), 2, "float32"),
    (torch.arange(256.0), 8, "pass grid=None"),
])
def test_bad_grid_is_refused(grid: torch.Tensor, bits: int, match: str) -> None:
    x = torch.randn(512)
    with pytest.raises(ValueError, match=match):
        torch.ops.daftrain.quantize_pack(x, bits, 256, 0, grid)
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, bits, 256, 0)
    with pytest.raises(ValueError, match=match):
        torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, 256, 512, torch.float32, grid)
