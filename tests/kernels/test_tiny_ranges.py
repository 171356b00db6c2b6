"""Groups whose step would be a float32 subnormal (``NOTE [ Tiny steps ]`` in ``kernels/reference.py``).

Before the fix, ``1 / step`` overflowed for such groups: every code saturated (errors of hundreds of
times the group's range) and in ReLU-like (zero-exact) groups the smallest positive value decoded to
0. Now the step is stored as 0: the decoded error stays within the group's range, masks stay exact,
the numba kernels stay byte-identical to the reference, and groups with a normal step keep their
bytes. (The Triton kernels are checked on the same inputs in ``test_triton.py``.)
"""

from __future__ import annotations

import pytest
import torch

from daftrain.kernels import cpu, reference, registry

MIN_NORMAL = 2.0**-126
BITS = (1, 2, 4, 8)
G = 32


@pytest.fixture(scope="module", autouse=True)
def fast_kernels() -> None:
    assert registry.load_fast_kernels().cpu == "numba"


def from_bits(*patterns: int) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def tiny_range_groups(bits: int) -> dict[str, torch.Tensor]:
    """One group of ``G`` float32 values per case."""
    gen = torch.Generator().manual_seed(bits)
    levels = (1 << bits) - 1
    cases: dict[str, torch.Tensor] = {}
    cases["one_ulp_subnormals"] = from_bits(*([1, 2] * (G // 2)))  # range 2**-149
    cases["subnormal_randn"] = torch.randn(G, generator=gen) * 1e-40
    cases["subnormal_offset"] = torch.linspace(0, 1, G) * 2.0**-140 + 2.0**-130  # all positive
    cases["subnormal_around_zero"] = torch.linspace(-1, 1, G) * 2.0**-135
    cases["normal_values_subnormal_range"] = from_bits(*[0x00900000 + k for k in range(G)])  # 2**-126 + k ulp
    # The step (max - min) / L right at the smallest normal float32: just below, at, just above.
    for name, scale in (("below", 1 - 2.0**-20), ("at", 1.0), ("above", 1 + 2.0**-20)):
        half = levels * MIN_NORMAL * scale / 2  # exact in float32
        cases[f"step_{name}_min_normal"] = torch.tensor([-half, half, 0.0, half / 3] * (G // 4))
    cases["relu_subnormal"] = torch.relu(torch.randn(G, generator=gen)) * 1e-39
    cases["relu_min_subnormal"] = torch.where(torch.arange(G) % 3 == 0, 0.0, from_bits(*([1] * G)))
    x = torch.relu(torch.randn(G, generator=gen)) * 1e-44
    x[0] = 0.0
    cases["relu_tiny_subnormal"] = x
    x = torch.relu(torch.randn(G, generator=gen))
    x[1], x[2] = 1e-45, 0.0
    cases["relu_subnormal_lo_normal_step"] = x  # lo subnormal, step normal: unchanged path
    x = torch.zeros(G)
    x[3], x[4] = 1e-40, 3e-40
    cases["relu_two_subnormals"] = x
    return cases


def as_int(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def decoded_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per value: the group's range (zero-exact groups: max - min positive, for the positive values)
    widened by the bfloat16 round-up of the step (< 2**-7 relative; the step is <= range / L), plus
    half an ulp of each decoded value for the float32 decode."""
    xd = x.double().view(-1, G)
    mn, mx = xd.min(1, keepdim=True).values, xd.max(1, keepdim=True).values
    pos = torch.where(xd > 0, xd, torch.inf).min(1, keepdim=True).values
    zero_exact = (mn == 0) & (mx > 0)
    rng = torch.where(zero_exact, mx - pos, mx - mn)
    ulp = torch.maximum(xd.abs().max(1, keepdim=True).values * 2.0**-24, torch.full_like(mx, 2.0**-149))
    return (rng * (1 + 2.0**-7) + ulp).expand_as(xd).reshape(-1)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("bits", BITS)
def test_tiny_ranges_decode_within_the_group_range(bits: int, dtype: torch.dtype) -> None:
    for name, x in tiny_range_groups(bits).items():
        x = x.to(dtype)
        for seed in range(4):
            codes, lo, scale = reference.quantize_pack(x, bits, G, seed)
            dec = reference.unpack_dequantize(codes, lo, scale, bits, G, x.numel(), torch.float32)
            err = (dec.double() - x.double()).abs()
            bound = decoded_error_bound(x.float())
            assert (err <= bound).all(), f"{name}: error {err.max().item():.3g} > bound {bound.max().item():.3g}"
            if x.min() == 0 and x.max() > 0:  # zero-exact: the mask is exact
                assert torch.equal(dec > 0, x > 0), name
                assert torch.equal(dec == 0, x == 0), name


@pytest.mark.parametrize("bits", BITS)
def test_subnormal_step_is_stored_as_zero(bits: int) -> None:
    """The spec: a positive subnormal step becomes 0 (its sign still says zero-exact); a normal one is
    kept, rounded up to bfloat16."""
    levels = (1 << bits) - 1
    groups = tiny_range_groups(bits)
    for name in ("one_ulp_subnormals", "subnormal_randn", "subnormal_offset", "step_below_min_normal"):
        _, lo, scale = reference.quantize_pack(groups[name], bits, G, 0)
        assert as_int(scale).item() == 0, name
        assert lo.item() == groups[name].min().item(), name
    for name in ("step_at_min_normal", "step_above_min_normal"):
        _, _, scale = reference.quantize_pack(groups[name], bits, G, 0)
        assert scale.float().item() >= MIN_NORMAL, name
    for name in ("relu_subnormal", "relu_two_subnormals"):
        _, _, scale = reference.quantize_pack(groups[name], bits, G, 0)
        assert as_int(scale).item() == -0x8000, name  # -0.0: zero-exact, step 0
    if levels >= 2:
        _, _, scale = reference.quantize_pack(groups["relu_subnormal_lo_normal_step"], bits, G, 0)
        assert torch.signbit(scale).item() and scale.abs().float().item() >= MIN_NORMAL


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("bits", BITS)
def test_numba_matches_reference_on_tiny_ranges(bits: int, dtype: torch.dtype) -> None:
    x = torch.cat(list(tiny_range_groups(bits).values())).to(dtype)
    x = torch.cat([x, torch.randn(5 * G, generator=torch.Generator().manual_seed(0)).to(dtype)])
    ref = reference.quantize_pack(x, bits, G, 7)
    for strategy in (cpu.PER_GROUP, cpu.TWO_LEVEL):
        got = cpu.quantize_pack_with(strategy, x, bits, G, 7)
        for what, a, b in zip(("codes", "lo", "scale"), got, ref, strict=True):
            assert torch.equal(as_int(a), as_int(b)), f"{what} ({strategy})"
    got = torch.ops.daftrain.quantize_pack(x, bits, G, 7)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(as_int(a), as_int(b))
    for out_dtype in (torch.float32, torch.bfloat16):
        dec = torch.ops.daftrain.unpack_dequantize(*ref, bits, G, x.numel(), out_dtype)
        assert torch.equal(as_int(dec), as_int(reference.unpack_dequantize(*ref, bits, G, x.numel(), out_dtype)))
