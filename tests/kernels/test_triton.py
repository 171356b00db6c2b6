"""The Triton kernels are byte-identical to the reference.

With CUDA they run compiled on the GPU. Without, on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, on while triton is first imported -- ``triton.jit`` reads it when it
decorates -- and while this module's tests run, not beyond). Skipped, with the reason, where triton
is not installed. The interpreter is slow: sizes stay small.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _import_triton():  # type: ignore[no-untyped-def]
    """Import triton; without CUDA in interpreter mode, which ``triton.jit`` reads when it decorates
    (triton's own library functions included), so it must be on before triton is first imported."""
    if CUDA or "triton" in sys.modules:
        return pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


triton = _import_triton()

# The interpreter evaluates with numpy, which warns on IEEE overflow / invalid / divide-by-zero that
# the kernels produce on purpose (3e38 + 3e38, inf - inf, 0 * inf).
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from daftrain.kernels import (  # noqa: E402
    ops,  # noqa: F401  (defines the custom ops)
    reference,
)

INF, NAN = math.inf, math.nan
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def tk():  # type: ignore[no-untyped-def]
    """The triton kernels module: compiled on a GPU, else interpreted on CPU tensors."""
    if CUDA:
        yield importlib.import_module("daftrain.kernels.triton")
        return
    import triton.language.standard as std

    if not isinstance(std.max, InterpretedFunction):
        pytest.skip("triton was imported before interpreter mode could be set; run this file on its own")
    saved_module = sys.modules.pop("daftrain.kernels.triton", None)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # also read at call time (lazy imports inside triton)
    try:
        yield importlib.import_module("daftrain.kernels.triton")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        sys.modules.pop("daftrain.kernels.triton", None)
        if saved_module is not None:
            sys.modules["daftrain.kernels.triton"] = saved_module


def as_int(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ia, ib = as_int(a.cpu()), as_int(b.cpu())
    if not torch.equal(ia, ib):
        bad = (ia != ib).nonzero()[:5].tolist()
        got, want = ia[ia != ib][:5].tolist(), ib[ia != ib][:5].tolist()
        pytest.fail(f"{what} differs at {bad}: triton {got} reference {want}")


def check(tk, x: torch.Tensor, bits: int, group_size: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    ref = reference.quantize_pack(x, bits, group_size, seed)
    for strategy in (tk.PER_GROUP, tk.TWO_LEVEL):
        got = tk.quantize_pack_with(strategy, x.to(DEV), bits, group_size, seed)
        for name, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
            assert_same(a, b, f"{name} ({strategy}, bits={bits}, G={group_size}, {x.dtype}, n={x.numel()})")
    dec = tk.unpack_dequantize(*(t.to(DEV) for t in ref), bits, group_size, x.numel(), x.dtype)
    assert_same(dec, reference.unpack_dequantize(*ref, bits, group_size, x.numel(), x.dtype), "decoded")
    into = torch.full((x.numel(),), float("nan"), dtype=x.dtype, device=DEV)
    tk.unpack_dequantize_into(into, *(t.to(DEV) for t in ref), bits, group_size)
    assert_same(into, dec, "decoded into")


def special(group_size: int) -> torch.Tensor:
    """Groups of one special kind each (see tests/kernels/test_cpu.py::special_inputs)."""
    gen = torch.Generator().manual_seed(3)
    G = group_size
    groups = [
        torch.zeros(G),
        torch.full((G,), -0.0),
        torch.full((G,), 3.25),
        torch.relu(torch.randn(G, generator=gen)),
        torch.where(torch.randn(G, generator=gen) > 0, 3e38, -3e38),
        torch.full((G,), INF),
        torch.full((G,), -INF),
        torch.full((G,), NAN),
        torch.cat([torch.full((G // 2,), -INF), torch.full((G // 2,), INF)]),
        torch.cat([torch.zeros(G - 1), torch.tensor([INF])]),
        torch.relu(torch.randn(G, generator=gen)) * 1e-39,
        torch.randn(G, generator=gen) * 7e4,
    ]
    x = torch.randn(G, generator=gen)
    x[3], x[5] = NAN, -INF
    groups.append(x)
    return torch.cat(groups)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random(tk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(1)
    for group_size, n in ((32, 1), (32, 75), (256, 300), (4096, 4096 + 64)):
        x = (torch.randn(n, generator=gen) * 2 - 1).to(dtype)
        assert_same(tk.minmax_per_group(x.to(DEV), group_size), reference.group_minmax(x, group_size), "stats")
        assert_same(tk.minmax_two_level(x.to(DEV), group_size), reference.group_minmax(x, group_size), "stats 2")
        for bits in (1, 2, 4, 8):
            if group_size == 4096 and bits in (1, 8):
                continue  # the interpreter is slow; 2 and 4 bits cover the 4096 path
            check(tk, x, bits, group_size, seed=n + bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(tk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    x = special(32).to(dtype)
    assert_same(tk.minmax_per_group(x.to(DEV), 32), reference.group_minmax(x, 32), "stats")
    for bits in (1, 2, 4, 8):
        check(tk, x, bits, 32, seed=2**32 + 7)


@pytest.mark.parametrize("seed", [2**31 - 1, 2**31, 2**32 - 1, 2**40 + 2**31 + 3, -1])
def test_every_32_bit_seed_draws_the_references_noise(tk, seed: int) -> None:  # type: ignore[no-untyped-def]
    # The kernels use the seed's low 32 bits as the reference does (``uniform_noise``), from 2**31 on too.
    x = torch.randn(2048, generator=torch.Generator().manual_seed(4))
    for bits in (2, 8):
        check(tk, x, bits, 256, seed=seed)


def test_zero_size_one_and_noncontiguous(tk) -> None:  # type: ignore[no-untyped-def]
    for n in (0, 1):
        check(tk, torch.full((n,), -1.5), 2, 32, 0)
    base = torch.randn(16, 20, generator=torch.Generator().manual_seed(2))
    check(tk, base.t(), 4, 64, 3)
    check(tk, base[:, ::2].to(torch.bfloat16), 2, 32, 3)


@pytest.mark.parametrize("bits", (1, 2, 4, 8))
def test_decode_any_bytes(tk, bits: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(bits)
    ng, G = 40, 32
    lo = torch.randint(-(2**31), 2**31, (ng,), dtype=torch.int64, generator=gen).to(torch.int32)
    specials = torch.tensor([0x7F800000, -0x00800000, 0x7FC00000, -0x00400000, 0x7F800001, 0, -(2**31)],
                            dtype=torch.int32)
    lo[: len(specials)] = specials
    scale = torch.randint(-(2**15), 2**15, (ng,), dtype=torch.int64, generator=gen).to(torch.int16)
    sspec = torch.tensor([0x7F80, -0x80, 0x7FC0, -0x40, 0x7F81, 0, -(2**15), 1, -0x7FFF, 0x3F80], dtype=torch.int16)
    scale[7 : 7 + len(sspec)] = sspec
    scale[20 : 20 + len(sspec)] = sspec
    codes = torch.randint(0, 256, (ng, G * bits // 8), dtype=torch.uint8, generator=gen)
    for dtype in DTYPES:
        args = (codes, lo.view(torch.float32), scale.view(torch.bfloat16), bits, G, ng * G - 3, dtype)
        dev_args = (*(t.to(DEV) for t in args[:3]), *args[3:])
        assert_same(tk.unpack_dequantize(*dev_args), reference.unpack_dequantize(*args), f"decode {dtype}")


def test_pack_bool(tk) -> None:  # type: ignore[no-untyped-def]
    for n in (1, 8, 1001):
        x = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
        packed = tk.pack_bool(x.to(DEV))
        assert_same(packed, reference.pack_bool(x), "pack_bool")
        assert_same(tk.unpack_bool(packed, n), x, "unpack_bool")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_registered_cuda_ops_match_reference() -> None:
    """On a GPU: the registered (compiled) Triton kernels against the reference run on the CPU."""
    from daftrain.kernels import registry

    status = registry.load_fast_kernels()
    assert status.cuda == "triton", status
    gen = torch.Generator().manual_seed(9)
    for dtype in DTYPES:
        x = torch.cat([torch.randn(100_000, generator=gen), special(256)]).to(dtype)
        for bits in (1, 2, 4, 8):
            for group_size in (32, 256, 65536):
                got = torch.ops.daftrain.quantize_pack(x.cuda(), bits, group_size, 11)
                ref = reference.quantize_pack(x, bits, group_size, 11)
                for a, b in zip(got, ref, strict=True):
                    assert_same(a, b, f"cuda {dtype} bits={bits} G={group_size}")
                dec = torch.ops.daftrain.unpack_dequantize(*got, bits, group_size, x.numel(), dtype)
                assert_same(dec, reference.unpack_dequantize(*ref, bits, group_size, x.numel(), dtype), "cuda decode")
                into = torch.empty_like(dec)
                torch.ops.daftrain.unpack_dequantize_into(into, *got, bits, group_size)
                assert_same(into, dec, "cuda decode into")
        x2 = x[-512 * 96:].reshape(512, 96)  # groups down the columns (the special groups among them)
        for bits in (1, 2, 4, 8):
            ref = reference.quantize_pack(reference.columns_first(x2, 96, 256), bits, 256, 11)
            got = torch.ops.daftrain.quantize_pack_columns(x2.cuda(), 96, bits, 256, 11)
            for a, b in zip(got, ref, strict=True):
                assert_same(a, b, f"cuda columns {dtype} bits={bits}")
            into = torch.empty(x2.numel(), dtype=dtype, device="cuda")
            torch.ops.daftrain.unpack_dequantize_columns_into(into, *got, 96, bits, 256)
            want = reference.unpack_dequantize(*ref, bits, 256, x2.numel(), dtype)
            assert_same(into, want.view(-1, 96, 256).transpose(1, 2).reshape(-1), "cuda columns decode")


def tiny_range_groups(levels: int) -> torch.Tensor:
    """Groups of 32 whose step is a float32 subnormal, or right at the smallest normal (``NOTE [ Tiny
    steps ]`` in ``kernels/reference.py``; ``test_tiny_ranges.py`` has the full set)."""
    gen = torch.Generator().manual_seed(levels)
    groups = [
        torch.tensor([1, 2] * 16, dtype=torch.int32).view(torch.float32),  # range 2**-149
        torch.randn(32, generator=gen) * 1e-40,
        torch.linspace(0, 1, 32) * 2.0**-140 + 2.0**-130,
        torch.relu(torch.randn(32, generator=gen)) * 1e-39,  # zero-exact, subnormal positives
        torch.where(torch.arange(32) % 3 == 0, 0.0, 1e-45),
    ]
    for scale in (1 - 2.0**-20, 1.0, 1 + 2.0**-20):  # step just below, at, just above 2**-126
        half = levels * 2.0**-126 * scale / 2
        groups.append(torch.tensor([-half, half, 0.0, half / 3] * 8))
    return torch.cat(groups)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_tiny_ranges(tk, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    for bits in (1, 2, 4, 8):
        check(tk, tiny_range_groups((1 << bits) - 1).to(dtype), bits, 32, seed=5)


def fitted_grid(bits: int, seed: int) -> torch.Tensor:
    """A random ascending grid from 0 to 2**bits - 1 (``layout.py``)."""
    levels = (1 << bits) - 1
    inner = torch.rand(levels - 1, generator=torch.Generator().manual_seed(seed)).sort().values * levels
    return torch.cat([torch.zeros(1), inner, torch.tensor([float(levels)])])


@pytest.mark.parametrize("bits", (2, 4))
def test_fitted_grid(tk, bits: int) -> None:  # type: ignore[no-untyped-def]
    grid = fitted_grid(bits, bits)
    gen = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        x = torch.cat([special(32), torch.randn(300, generator=gen) * 3]).to(dtype)
        ref = reference.quantize_pack(x, bits, 32, 2**31 + 9, grid)
        for strategy in (tk.PER_GROUP, tk.TWO_LEVEL):
            got = tk.quantize_pack_with(strategy, x.to(DEV), bits, 32, 2**31 + 9, grid.to(DEV))
            for name, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
                assert_same(a, b, f"{name} on a grid ({strategy}, bits={bits}, {dtype})")
        args = (*(t.to(DEV) for t in ref), bits, 32, x.numel(), dtype, grid.to(DEV))
        want = reference.unpack_dequantize(*ref, bits, 32, x.numel(), dtype, grid)
        assert_same(tk.unpack_dequantize(*args), want, f"decoded on a grid ({dtype})")


def check_columns(tk, x: torch.Tensor, bits: int, group_size: int, seed: int,  # type: ignore[no-untyped-def]
                  grid: torch.Tensor | None) -> None:
    """The column kernels against the reference's reordering around the row reference, byte for byte
    (``NOTE [ Groups down the columns on a GPU ]``)."""
    from daftrain.kernels.reduction import ReductionSelector

    cols = x.shape[1]
    ref = reference.quantize_pack(reference.columns_first(x, cols, group_size), bits, group_size, seed, grid)
    kernels = tk.make_kernels(ReductionSelector(DEV, tk.STRATEGIES, forced=tk.PER_GROUP))
    dev_grid = None if grid is None else grid.to(DEV)
    got = kernels["quantize_pack_columns"](x.reshape(-1).to(DEV), cols, bits, group_size, seed, dev_grid)
    what = f"bits={bits}, G={group_size}, cols={cols}, {x.dtype}, grid={grid is not None}"
    for name, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
        assert_same(a, b, f"{name} by columns ({what})")
    for dtype in DTYPES:
        decoded = reference.unpack_dequantize(*ref, bits, group_size, x.numel(), dtype, grid)
        want = decoded.view(-1, cols, group_size).transpose(1, 2).reshape(-1)
        into = torch.full((x.numel(),), NAN, dtype=dtype, device=DEV)  # every value must be overwritten
        tk.unpack_dequantize_columns_into(into, *(t.to(DEV) for t in ref), cols, bits, group_size, dev_grid)
        assert_same(into, want, f"decoded by columns into {dtype} ({what})")


@pytest.mark.parametrize("group_size, cols", [(32, 1), (32, 7), (64, 40)])
def test_column_kernels(tk, group_size: int, cols: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(cols)
    n = 2 * group_size * cols
    special_rows = special(group_size)
    x = torch.randn(2 * group_size, cols, generator=gen) * 3
    x.view(-1)[: min(n, special_rows.numel())] = special_rows[:n]  # special values land in some columns' groups
    x[:, 0] = x[:, 0].relu()
    x[group_size:, cols - 1] = INF
    for dtype in DTYPES:
        for bits in (1, 2, 4, 8):
            check_columns(tk, x.to(dtype), bits, group_size, 3 + bits, None)
        for bits in (2, 4):
            check_columns(tk, x.to(dtype), bits, group_size, 2**31 + bits, fitted_grid(bits, bits))
