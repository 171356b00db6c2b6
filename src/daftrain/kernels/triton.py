"""Triton kernels for the ``daftrain::`` custom ops (CUDA), byte-identical to ``kernels/reference.py``.

Same arithmetic as the numba kernels (``cpu.py``, whose docstring lists the rules): stats on
order-preserving integer keys (exact, any reduction order), ``group_params`` with its NaN cases
spelled out on bits, codes with ``t = (x - lo) * inv``, ``inv = div_rn(1, step)`` (correctly rounded;
Triton's plain ``/`` is not), ``floor(t + u)``, decoding ``lo + (c - z) * step`` with two roundings and
its NaN cases on bits, float32 -> float16/bfloat16 of decoded values on bits (never the hardware
conversion, whose NaN differs from PyTorch CPU's), all divisions ``div_rn``. Every launch passes
``enable_fp_fusion=False`` so that no multiply-add is contracted into an FMA.

Registered for the ``cuda`` key by ``registry.py`` when CUDA is available and triton imports. The
tests run the same kernels on CPU tensors under ``TRITON_INTERPRET=1``.

Two schedules for the per-group min/max (see ``reduction.py``): ``per_group`` (one program per group
looping over it; ``quantize_pack`` fuses stats, params and codes in that program) and ``two_level``
(one program per tile of a group writes partial keys, a second kernel combines them per group and
computes the params; the codes then run one program per tile) for few, huge groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from . import ops, reference
from .reduction import ReductionSelector

__all__ = [
    "PER_GROUP",
    "STRATEGIES",
    "TWO_LEVEL",
    "make_kernels",
    "minmax_per_group",
    "minmax_two_level",
    "parallelism",
    "quantize_pack_with",
    "unpack_dequantize_columns_into",
    "unpack_dequantize_into",
]

PER_GROUP = "per_group"
TWO_LEVEL = "two_level"

_LAUNCH: dict[str, Any] = {"enable_fp_fusion": False}

_INF = 0x7F800000
_NAN = 0x7FC00000


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_bits(ptr, offs, mask, KIND: tl.constexpr):
    """float32 bits (int32) of elements ``offs``. KIND 0: ptr is int32 (float32 bits), 1: int16
    (bfloat16 bits), 2: float16 (converted exactly; a NaN's payload does not matter downstream)."""
    if KIND == 0:
        b = tl.load(ptr + offs, mask=mask, other=0)
    elif KIND == 1:
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16
    else:
        b = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    return b


@triton.jit
def _key(b):
    """float32 bits -> int32 whose signed order is IEEE 754's total order."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _range_keys(x_ptr, addr0, count, stride, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """(min key, max key, min positive bits) of the ``count`` elements ``addr0 + k * stride`` (int64):
    a group of the row layout (``stride`` 1), or a group down a column (``NOTE [ Groups down the columns
    on a GPU ]``)."""
    kmin = tl.full([BLOCK], 2147483647, tl.int32)
    kmax = tl.full([BLOCK], -2147483648, tl.int32)
    pmin = tl.full([BLOCK], 0x7F800000, tl.int32)
    for s in range(0, count, BLOCK):
        k = s + tl.arange(0, BLOCK)
        m = k < count
        b = _load_bits(x_ptr, addr0 + k * stride, m, KIND)
        key = _key(b)
        kmin = tl.minimum(kmin, tl.where(m, key, 2147483647))
        kmax = tl.maximum(kmax, tl.where(m, key, -2147483648))
        pos = m & (b > 0) & (b <= 0x7F800000)
        pmin = tl.minimum(pmin, tl.where(pos, b, 0x7F800000))
    return tl.min(kmin, axis=0), tl.max(kmax, axis=0), tl.min(pmin, axis=0)


@triton.jit
def _stats_bits(kmin, kmax, pmin):
    """Keys -> float32 bits (min, max, min positive); a NaN anywhere -> canonical 0x7fc00000."""
    nan = (kmin < -0x7F800001) | (kmax > 0x7F800000)
    mn = tl.where(nan, 0x7FC00000, _key(kmin))
    mx = tl.where(nan, 0x7FC00000, _key(kmax))
    return mn, mx, pmin


@triton.jit
def _bf16_round_up(step):
    """float32 -> bfloat16 bits rounded up (low 16 bits of an int32), as ``reference._bf16_round_up``."""
    b = step.to(tl.int32, bitcast=True)
    finite = (b & 0x7FFFFFFF) < 0x7F800000
    return tl.where(finite, (b + 0xFFFF) >> 16, b >> 16) & 0xFFFF


@triton.jit
def _flush_tiny(step):
    """A positive subnormal step -> 0 (``NOTE [ Tiny steps ]`` in ``reference.py``), compared on bits."""
    b = step.to(tl.int32, bitcast=True)
    return tl.where((b > 0) & (b < 0x00800000), 0.0, step)


@triton.jit
def _params(mn_b, mx_b, mp_b, BITS: tl.constexpr):
    """Stats bits -> (lo float32 bits, scale bfloat16 bits in an int32), as ``reference.group_params``."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    mn = mn_b.to(tl.float32, bitcast=True)
    mx = mx_b.to(tl.float32, bitcast=True)
    mp = mp_b.to(tl.float32, bitcast=True)
    zero_exact = (mn == 0.0) & (mx > 0.0)
    if LEVELS >= 2:
        step_z = _flush_tiny(tl.math.div_rn(mx - mp, tl.full([], LEVELS - 1, tl.float32)))
        scale_z = tl.where(mp_b == 0x7F800000, 0x7FC0, _bf16_round_up(step_z) | 0x8000)
        lo_z = mp_b
    else:
        lo_z = ((mp + mx) * 0.5).to(tl.int32, bitcast=True)
        scale_z = tl.full([], 0x8000, tl.int32)
    step_p = _flush_tiny(tl.math.div_rn(mx - mn, tl.full([], LEVELS, tl.float32)))
    all_inf = (mn_b == mx_b) & ((mn_b & 0x7FFFFFFF) == 0x7F800000)
    scale_p = tl.where(mn != mn, 0x7FC0, tl.where(all_inf, 0xFFC0, _bf16_round_up(step_p)))
    lo = tl.where(zero_exact, lo_z, mn_b)
    scale = tl.where(zero_exact, scale_z, scale_p)
    return lo, scale


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * tl.full([], 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full([], 0xC2B2AE35, tl.uint32)
    h = h ^ (h >> 16)
    return h


@triton.jit
def _quantize_span(
    x_ptr, codes_ptr, n, g_start, span_start, span_len, addr0, stride, byte0, lo_b, scale_b, seed, grid_ptr,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr,
):
    """Codes of the ``span_len`` values (a multiple of 32) from ``g_start + span_start`` of one group (the
    group's value ``k`` read at element ``addr0 + k * stride``), packed into bytes from ``codes_ptr +
    byte0``; values at index >= n are padding (code 0). With ``GRID``, a plain group with finite lo and
    step rounds onto the fitted grid at ``grid_ptr``."""
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = BLOCK // PER
    LEVELS: tl.constexpr = (1 << BITS) - 1
    lo = lo_b.to(tl.float32, bitcast=True)
    step = ((scale_b << 16) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    zero_exact = (scale_b & 0x8000) != 0
    inv = tl.where(step > 0.0, tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(step > 0.0, step, 1.0)), 0.0)
    top = tl.where(zero_exact, LEVELS - 1.0, LEVELS * 1.0)
    bytes_local = tl.arange(0, NB)
    lane = tl.arange(0, PER)
    for c0 in range(0, span_len, BLOCK):
        j = c0 + bytes_local[:, None] * PER + lane[None, :]  # [NB, PER] index inside the span
        i = g_start + span_start + j  # stored index (int64): the noise's
        m = (j < span_len) & (i < n)
        b = _load_bits(x_ptr, addr0 + (span_start + j) * stride, m, KIND)
        x = b.to(tl.float32, bitcast=True)
        h = _fmix32(i.to(tl.uint32) ^ seed.to(tl.uint32, bitcast=True))
        u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08
        t = (x - lo) * inv
        r = tl.floor(t + u)
        if GRID:
            on_grid = ((scale_b & 0x8000) == 0) & ((lo_b & 0x7F800000) != 0x7F800000) & (
                ((scale_b << 16) & 0x7F800000) != 0x7F800000)
            k = tl.zeros_like(j).to(tl.int32)
            for level in tl.static_range(1, LEVELS):
                k += (t >= tl.load(grid_ptr + level)).to(tl.int32)
            below = tl.load(grid_ptr + k)
            width = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(grid_ptr + k + 1) - below)
            position = k.to(tl.float32) + (t - below) * width
            r = tl.where(on_grid, tl.floor(position + u), r)
        c = tl.where(r > 0.0, r, 0.0)  # NaN -> 0
        c = tl.where(c < top, c, top)
        code = c.to(tl.int32)
        code = tl.where(zero_exact, tl.where((x == 0.0) | (r != r), 0, code + 1), code)
        code = tl.where(m, code, 0)
        packed = tl.sum(code << (lane[None, :] * BITS), axis=1)
        nbytes = (span_len - c0) // PER
        tl.store(codes_ptr + byte0 + c0 // PER + bytes_local, packed.to(tl.uint8), mask=bytes_local < nbytes)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _minmax_per_group_kernel(x_ptr, out_ptr, n, G, KIND: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    start = g * G
    stop = tl.minimum(start + G, n)
    kmin, kmax, pmin = _range_keys(x_ptr, start, stop - start, 1, KIND, BLOCK)
    mn, mx, mp = _stats_bits(kmin, kmax, pmin)
    tl.store(out_ptr + 3 * g, mn)
    tl.store(out_ptr + 3 * g + 1, mx)
    tl.store(out_ptr + 3 * g + 2, mp)


@triton.jit
def _tile_keys_kernel(x_ptr, part_ptr, n, G, TILE, TPG, KIND: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = t // TPG
    start = g * G + (t % TPG) * TILE
    stop = tl.minimum(tl.minimum(start + TILE, g * G + G), n)
    kmin, kmax, pmin = _range_keys(x_ptr, start, tl.maximum(start, stop) - start, 1, KIND, BLOCK)
    tl.store(part_ptr + 3 * t, kmin)
    tl.store(part_ptr + 3 * t + 1, kmax)
    tl.store(part_ptr + 3 * t + 2, pmin)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, lo_ptr, scale_ptr, TPG, BITS: tl.constexpr, WITH_PARAMS: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    kmin = tl.full([BLOCK_T], 2147483647, tl.int32)
    kmax = tl.full([BLOCK_T], -2147483648, tl.int32)
    pmin = tl.full([BLOCK_T], 0x7F800000, tl.int32)
    for s in range(0, TPG, BLOCK_T):
        offs = s + tl.arange(0, BLOCK_T)
        m = offs < TPG
        base = part_ptr + 3 * (g * TPG + offs)
        kmin = tl.minimum(kmin, tl.load(base, mask=m, other=2147483647))
        kmax = tl.maximum(kmax, tl.load(base + 1, mask=m, other=-2147483648))
        pmin = tl.minimum(pmin, tl.load(base + 2, mask=m, other=0x7F800000))
    mn, mx, mp = _stats_bits(tl.min(kmin, axis=0), tl.max(kmax, axis=0), tl.min(pmin, axis=0))
    tl.store(stats_ptr + 3 * g, mn)
    tl.store(stats_ptr + 3 * g + 1, mx)
    tl.store(stats_ptr + 3 * g + 2, mp)
    if WITH_PARAMS:
        lo, scale = _params(mn, mx, mp, BITS)
        tl.store(lo_ptr + g, lo)
        tl.store(scale_ptr + g, scale.to(tl.int16))


@triton.jit
def _quantize_per_group_kernel(
    x_ptr, codes_ptr, lo_ptr, scale_ptr, n, G, seed, grid_ptr, cols,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    start = g * G
    if COLUMNS:  # group g: column g % cols of the block of G rows g // cols
        block = g // cols
        addr0 = block * G * cols + (g - block * cols)
        stride = cols
        count = G
    else:
        addr0 = start
        stride = 1
        count = tl.minimum(start + G, n) - start
    kmin, kmax, pmin = _range_keys(x_ptr, addr0, count, stride, KIND, BLOCK_S)
    mn, mx, mp = _stats_bits(kmin, kmax, pmin)
    lo, scale = _params(mn, mx, mp, BITS)
    tl.store(lo_ptr + g, lo)
    tl.store(scale_ptr + g, scale.to(tl.int16))
    _quantize_span(x_ptr, codes_ptr, n, start, 0, G, addr0, stride, g * (G * BITS // 8), lo, scale, seed, grid_ptr,
                   KIND, BITS, BLOCK, GRID)


@triton.jit
def _quantize_tiles_kernel(
    x_ptr, codes_ptr, lo_ptr, scale_ptr, n, G, TILE, TPG, seed, grid_ptr,
    KIND: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = t // TPG
    off = (t % TPG) * TILE
    span = tl.minimum(TILE, G - off)
    lo = tl.load(lo_ptr + g)
    scale = tl.load(scale_ptr + g).to(tl.int32) & 0xFFFF
    _quantize_span(
        x_ptr, codes_ptr, n, g * G, off, span, g * G, 1, g * (G * BITS // 8) + off * BITS // 8, lo, scale, seed,
        grid_ptr, KIND, BITS, BLOCK, GRID,
    )


@triton.jit
def _f32_to_bf16_bits(b):
    lsb = (b >> 16) & 1
    r = ((b + 0x7FFF + lsb) >> 16) & 0xFFFF
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0xFFFF, r)


@triton.jit
def _f32_to_f16_bits(b):
    """Round to nearest even on integers only (no float op, so no flush-to-zero can interfere)."""
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    t = a - 0x38000000
    normal = (t + 0xFFF + ((t >> 13) & 1)) >> 13
    e = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(126 - e, 31)  # value * 2**24 = mant >> shift (a normal float32, e >= 1)
    shift = tl.maximum(shift, 1)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    sub = tl.where(e == 0, 0, sub)  # float32 subnormal: far below the smallest float16
    r = tl.where(a >= 0x38800000, normal, sub)
    r = tl.where(a >= 0x477FF000, 0x7C00, r)
    r = tl.where(a > 0x7F800000, 0x7E00 | ((a >> 13) & 0x3FF), r)
    return r | sign


@triton.jit
def _dequantize_kernel(
    codes_ptr, lo_ptr, scale_ptr, out_ptr, numel, G, grid_ptr, cols,
    BITS: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr, COLUMNS: tl.constexpr,
):
    """One program per BLOCK output values, in the output's order. OUT 0: float32 (int32 bits), 1: bfloat16,
    2: float16 (int16). With ``GRID``, plain groups with finite lo and step decode code ``c`` as ``lo + g[c]
    * step``. With ``COLUMNS``, output element ``row * cols + col`` is value ``row % G`` of group
    ``(row // G) * cols + col`` (``NOTE [ Groups down the columns on a GPU ]``)."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    if COLUMNS:
        row = offs // cols
        block = row // G
        j = row - block * G
        g = block * cols + (offs - row * cols)
    else:
        g = offs // G
        j = offs - g * G
    byte = tl.load(codes_ptr + g * (G * BITS // 8) + j // PER, mask=m, other=0).to(tl.int32)
    c = (byte >> ((j % PER) * BITS).to(tl.int32)) & MASK
    lo_b = tl.load(lo_ptr + g, mask=m, other=0)
    sb = tl.load(scale_ptr + g, mask=m, other=0).to(tl.int32)
    step_b = (sb << 16) & 0x7FFFFFFF
    lo = lo_b.to(tl.float32, bitcast=True)
    step = step_b.to(tl.float32, bitcast=True)
    zero_exact = (sb & 0x8000) != 0
    k = c.to(tl.float32) - tl.where(zero_exact, 1.0, 0.0)
    if GRID:
        on_grid = ((sb & 0x8000) == 0) & ((lo_b & 0x7F800000) != 0x7F800000) & ((step_b & 0x7F800000) != 0x7F800000)
        k = tl.where(on_grid, tl.load(grid_ptr + c, mask=m, other=0.0), k)
    # NaN rules of the reference on x86: a NaN operand propagates quieted (the second if both are),
    # an invalid operation (0 * inf, inf - inf) gives the default NaN 0xffc00000.
    prod_b = (k * step).to(tl.int32, bitcast=True)
    prod_b = tl.where((k == 0.0) & (step_b == 0x7F800000), -0x00400000, prod_b)
    prod_b = tl.where(step != step, step_b | 0x00400000, prod_b)
    prod = prod_b.to(tl.float32, bitcast=True)
    v_b = (lo + prod).to(tl.int32, bitcast=True)
    clash = ((lo_b & 0x7FFFFFFF) == 0x7F800000) & ((prod_b & 0x7FFFFFFF) == 0x7F800000) & (lo_b != prod_b)
    v_b = tl.where(clash, -0x00400000, v_b)
    v_b = tl.where(lo != lo, lo_b | 0x00400000, v_b)
    v_b = tl.where(prod != prod, prod_b, v_b)
    v_b = tl.where(zero_exact & (c == 0), 0, v_b)
    if OUT == 0:
        tl.store(out_ptr + offs, v_b, mask=m)
    elif OUT == 1:
        tl.store(out_ptr + offs, _f32_to_bf16_bits(v_b).to(tl.int16), mask=m)
    else:
        tl.store(out_ptr + offs, _f32_to_f16_bits(v_b).to(tl.int16), mask=m)


@triton.jit
def _pack_bool_kernel(x_ptr, out_ptr, n, nbytes, NB: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
    s = tl.arange(0, 8)
    i = k[:, None] * 8 + s[None, :]
    v = tl.load(x_ptr + i, mask=i < n, other=0)
    bits = tl.where(v != 0, 1, 0) << s[None, :]
    tl.store(out_ptr + k, tl.sum(bits, axis=1).to(tl.uint8), mask=k < nbytes)


@triton.jit
def _unpack_bool_kernel(p_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    byte = tl.load(p_ptr + i // 8, mask=m, other=0).to(tl.int32)
    tl.store(out_ptr + i, ((byte >> (i % 8).to(tl.int32)) & 1).to(tl.uint8), mask=m)


# ---------------------------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------------------------


def parallelism(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of ``device`` (the current CUDA device by default; 1 without CUDA: the
    interpreter)."""
    if not torch.cuda.is_available():
        return 1
    return _multiprocessors(torch.cuda.current_device() if device is None or device.index is None else device.index)


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous()


_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' KIND / OUT


def _input(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A float tensor as the kernels load it (``_load_bits``) and its KIND."""
    kind = _KIND[x.dtype]
    return (x.view(torch.int32) if kind == 0 else x.view(torch.int16) if kind == 1 else x), kind


def _as_int32(seed: int) -> int:
    """The low 32 bits of ``seed`` as a signed 32-bit value, which the kernels bitcast to ``uint32``.

    NOTE [ Seeds as int32 ]
    Triton types a Python ``int`` argument by its value: ``i32`` below ``2**31``, ``i64`` above. A seed
    from ``2**31`` on would make ``i ^ seed`` an ``int64``, and the hash's shifts and multiplications would
    no longer wrap at 32 bits: noise, and codes, other than the reference's. Every seed is passed in
    ``i32``'s range, one type, and bitcast to ``uint32`` in the kernel."""
    low = seed & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def _block(group_size: int, cap: int = 1024) -> int:
    return min(cap, triton.next_power_of_2(group_size))


def _tiling(group_size: int, num_groups: int) -> tuple[int, int]:
    """(tile, tiles per group): tiles are powers of two >= 1024 values, about 4 programs per SM."""
    want = max(1, -(-4 * parallelism() // max(num_groups, 1)))
    tile = max(1024, triton.next_power_of_2(-(-group_size // want)))
    tile = min(tile, triton.next_power_of_2(group_size))
    return tile, -(-group_size // tile)


def minmax_per_group(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``group_minmax``, one program per group (x flat and contiguous)."""
    n = x.numel()
    ng = -(-n // group_size)
    out = torch.empty(ng, 3, dtype=torch.float32, device=x.device)
    if ng:
        xb, kind = _input(x)
        _minmax_per_group_kernel[(ng,)](
            xb, out.view(torch.int32), n, group_size, KIND=kind, BLOCK=_block(group_size, 2048), **_LAUNCH
        )
    return out


def _two_level_stats(
    x: torch.Tensor, group_size: int, bits: int, lo: torch.Tensor | None, scale: torch.Tensor | None
) -> tuple[torch.Tensor, int, int]:
    n = x.numel()
    ng = -(-n // group_size)
    out = torch.empty(ng, 3, dtype=torch.float32, device=x.device)
    tile, tpg = _tiling(group_size, ng)
    part = torch.empty(ng * tpg, 3, dtype=torch.int32, device=x.device)
    xb, kind = _input(x)
    _tile_keys_kernel[(ng * tpg,)](
        xb, part, n, group_size, tile, tpg, KIND=kind, BLOCK=_block(tile, 2048), **_LAUNCH
    )
    with_params = lo is not None and scale is not None
    _combine_kernel[(ng,)](
        part,
        out.view(torch.int32),
        lo.view(torch.int32) if with_params else out,
        scale.view(torch.int16) if with_params else out,
        tpg,
        BITS=bits,
        WITH_PARAMS=with_params,
        BLOCK_T=min(1024, triton.next_power_of_2(tpg)),
        **_LAUNCH,
    )
    return out, tile, tpg


def minmax_two_level(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``group_minmax``, partial keys per tile then a combine per group (x flat and contiguous)."""
    if x.numel() == 0:
        return torch.empty(0, 3, dtype=torch.float32, device=x.device)
    return _two_level_stats(x, group_size, 1, None, None)[0]


STRATEGIES = {PER_GROUP: minmax_per_group, TWO_LEVEL: minmax_two_level}


def make_kernels(selector: ReductionSelector) -> dict[str, Callable[..., Any]]:
    """The op kernels by op name, ``group_minmax`` / ``quantize_pack`` scheduled by ``selector``;
    they trust their arguments (``NOTE [ What the kernels trust ]`` in ``cpu.py``)."""

    def group_minmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
        flat = _flat(x)
        return STRATEGIES[selector.choose(flat.numel(), group_size, flat.dtype)](flat, group_size)

    def quantize_pack(
        x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = _flat(x)
        n = flat.numel()
        ng = -(-n // group_size)
        codes, lo, scale = _payload_for(ng, group_size, bits, flat.device)
        if ng == 0:
            return codes, lo, scale
        # The tiled schedule reads the input twice; it only pays with few groups per SM.
        few = ng < 8 * parallelism(flat.device)
        if few and selector.choose(n, group_size, flat.dtype) == TWO_LEVEL:
            xb, kind = _input(flat)
            _, tile, tpg = _two_level_stats(flat, group_size, bits, lo, scale)
            _quantize_tiles_kernel[(ng * tpg,)](
                xb, codes, lo.view(torch.int32), scale.view(torch.int16), n, group_size, tile, tpg, _as_int32(seed),
                lo if grid is None else grid, KIND=kind, BITS=bits, BLOCK=min(_block(group_size, 1024), tile),
                GRID=grid is not None, **_LAUNCH,
            )
        else:
            _quantize_groups(flat, 0, bits, group_size, seed, grid, codes, lo, scale)
        return codes, lo, scale

    def quantize_pack_columns(
        x: torch.Tensor, cols: int, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = _flat(x)
        ng = flat.numel() // group_size
        codes, lo, scale = _payload_for(ng, group_size, bits, flat.device)
        if ng:
            _quantize_groups(flat, cols, bits, group_size, seed, grid, codes, lo, scale)
        return codes, lo, scale

    return {fn.__name__: fn for fn in (group_minmax, quantize_pack, reference.seeded(quantize_pack), unpack_dequantize,
                                       unpack_dequantize_into, quantize_pack_columns, unpack_dequantize_columns_into,
                                       pack_bool, unpack_bool)}


def _payload_for(num_groups: int, group_size: int, bits: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(codes, lo, scale)`` for ``num_groups`` groups."""
    return (torch.empty(num_groups, group_size * bits // 8, dtype=torch.uint8, device=device),
            torch.empty(num_groups, dtype=torch.float32, device=device),
            torch.empty(num_groups, dtype=torch.bfloat16, device=device))


# NOTE [ Groups down the columns on a GPU ]
# ``quantize_pack_columns`` stores a ``[rows, cols]`` tensor as ``quantize_pack`` stores the reference's
# ``columns_first`` copy of it (``NOTE [ The stored order of groups down the columns ]`` in ``reference.py``).
# The kernels read that order where it lies instead of copying it first: a program quantizes one group,
# one column of ``G`` rows, at a stride of ``cols`` elements (its neighbours read the adjacent columns of
# the same rows, which the cache serves), with the stored index as the noise's; the decode runs in the
# output's order and reads each value's code where the stored order keeps it. No copy of the tensor is
# made at either end, and each is one launch.
def _quantize_groups(
    flat: torch.Tensor, cols: int, bits: int, group_size: int, seed: int, grid: torch.Tensor | None,
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor,
) -> None:
    """One program per group: the row layout (``cols`` 0) or groups down ``cols`` columns."""
    xb, kind = _input(flat)
    _quantize_per_group_kernel[(lo.numel(),)](
        xb, codes, lo.view(torch.int32), scale.view(torch.int16), flat.numel(), group_size, _as_int32(seed),
        lo if grid is None else grid, max(cols, 1), KIND=kind, BITS=bits, BLOCK_S=_block(group_size, 2048),
        BLOCK=_block(group_size, 1024), GRID=grid is not None, COLUMNS=cols > 0, **_LAUNCH,
    )


def unpack_dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
    grid: torch.Tensor | None = None,
) -> None:
    """Decode into a preallocated contiguous 1-D ``out`` (its dtype and numel say what to decode)."""
    _decode(out, codes, lo, scale, bits, group_size, grid, 0)


def unpack_dequantize_columns_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, cols: int, bits: int,
    group_size: int, grid: torch.Tensor | None = None,
) -> None:
    """Decode what ``quantize_pack_columns`` wrote into the flat ``out``, row after row (``NOTE [ Groups down
    the columns on a GPU ]``)."""
    _decode(out, codes, lo, scale, bits, group_size, grid, cols)


def _decode(out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
            group_size: int, grid: torch.Tensor | None, cols: int) -> None:
    numel = out.numel()
    if numel == 0:
        return
    kind = _KIND[out.dtype]
    block = 1024
    _dequantize_kernel[(triton.cdiv(numel, block),)](
        codes.detach().contiguous(),
        lo.detach().contiguous().view(torch.int32),
        scale.detach().contiguous().view(torch.int16),
        out.view(torch.int32) if kind == 0 else out.view(torch.int16),
        numel,
        group_size,
        lo if grid is None else grid,
        max(cols, 1),
        BITS=bits,
        OUT=kind,
        BLOCK=block,
        GRID=grid is not None,
        COLUMNS=cols > 0,
        **_LAUNCH,
    )


unpack_dequantize = reference.allocating(unpack_dequantize_into)


def pack_bool(x: torch.Tensor) -> torch.Tensor:
    flat = _flat(x)
    n = flat.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    if n:
        nb = 128
        _pack_bool_kernel[(triton.cdiv(nbytes, nb),)](flat.view(torch.uint8), out, n, nbytes, NB=nb, **_LAUNCH)
    return out


def unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.bool, device=packed.device)
    if numel:
        block = 1024
        _unpack_bool_kernel[(triton.cdiv(numel, block),)](
            packed.detach().contiguous().view(-1), out.view(torch.uint8), numel, BLOCK=block, **_LAUNCH
        )
    return out


def quantize_pack_with(
    strategy: str, x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_pack`` with a forced schedule, for tests and benchmarks; it bypasses the op, so it
    runs the op's check itself."""
    ops.quantize_pack.check(x, bits, group_size, seed, grid)
    forced = ReductionSelector(x.device.type, STRATEGIES, forced=strategy)
    return make_kernels(forced)["quantize_pack"](x, bits, group_size, seed, grid)
