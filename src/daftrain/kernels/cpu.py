"""Numba CPU kernels for the ``daftrain::`` custom ops, byte-identical to ``kernels/reference.py``.

Layout and arithmetic follow ``layout.py``; every float operation is a float32 operation with one
rounding (``fastmath=False``: no FMA contraction, no reassociation, denormals kept), and everything
whose result the reference defines only through x86/PyTorch behaviour is done explicitly on bits:

* **stats** use an integer key per value, ``k = b ^ ((b >> 31) & 0x7fffffff)`` on the float32 bits
  ``b``, whose signed order is IEEE 754's total order. Min/max of the keys are exact, vectorise as
  plain integer min/max, and do not depend on the reduction order (so neither on the thread count
  nor on the reduction strategy, see ``reduction.py``). Any NaN in a group makes its min and max
  the canonical quiet NaN ``0x7fc00000`` (what PyTorch's CPU ``amin``/``amax`` return). Between
  ``-0.0`` and ``+0.0`` the total order picks ``-0.0`` for the min and ``+0.0`` for the max; the
  reference leaves that tie to PyTorch's vectorised reduction (see the report in
  ``tests/kernels/test_cpu.py::test_signed_zero_tie``). It only shows in the stats of a group
  whose min or max is a zero of both signs, and in ``lo`` of a group made only of zeros of both signs.
* **NaN results** of ``group_params`` (``inf - inf`` of an all-``±inf`` group is x86's default NaN
  ``0xffc00000``, whose sign bit then reads as zero-exact mode) and of decoding are produced from
  explicit rules that reproduce the reference on x86 (``_params``, ``_decode_special``), not left to
  whatever NaN payload LLVM's instruction selection would produce.
* float32 -> float16/bfloat16 conversion of decoded values is done on bits: round to nearest even,
  float16 NaN keeps sign and top payload bits (x86 F16C, as PyTorch), bfloat16 NaN is ``0xffff``
  (PyTorch's vectorised conversion).
* the noise hash is computed in uint32 with wrap-around; ``u`` is exact in float32.

Kernels work on raw bits: float32 input as int32, bfloat16 as int16 and float16 as uint16, each a
separate numba specialisation (``_load_bits`` dispatches on the element type at compile time).

``quantize_pack`` has two schedules: ``per_group`` (one task per run of whole groups: stats, params,
codes and packing of a group while it is hot in cache -- the input is read once) and ``two_level``
(tiles inside groups: partial stats per tile in parallel, a combine per group, then codes per tile in
parallel -- the input is read twice) for few, huge groups. With fewer than 8 groups per thread the
``ReductionSelector`` (``reduction.py``) picks between them; with more, ``per_group`` always runs.
Both produce the same bytes. ``make_kernels(selector)`` returns the op kernels by name; ``registry.py``
registers them for the ``cpu`` device key, behind the ops' argument checks (``NOTE [ What the kernels
trust ]``).

Module state: ``_pool_started`` (numba's thread pool, see NOTE [ numba's thread pool and
PyTorch's OpenMP runtime ]), ``_WORKQUEUE_LOCK`` / ``_layer_checked`` (whether numba runs its non-thread-safe
workqueue layer, then calls are serialised), ``warmup``'s cache (it ran, see NOTE [ Kernels load
before the first step ]), ``_madvise`` (libc handle). Nothing else is global.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from . import ops, reference
from .reduction import ReductionSelector

__all__ = [
    "PER_GROUP",
    "STRATEGIES",
    "STREAMING_BYTES",
    "TWO_LEVEL",
    "make_kernels",
    "minmax_per_group",
    "minmax_two_level",
    "pack_bool",
    "quantize_pack_columns",
    "quantize_pack_with",
    "streams",
    "threads",
    "unpack_bool",
    "unpack_dequantize",
    "unpack_dequantize_columns_into",
    "unpack_dequantize_into",
    "warmup",
]

PER_GROUP = "per_group"
TWO_LEVEL = "two_level"

_JIT = {"cache": True, "nogil": True, "fastmath": False}
_PJIT = {"parallel": True, **_JIT}

# float32 bit patterns
_NAN = 0x7FC00000  # canonical quiet NaN (PyTorch CPU amin/amax of a group with a NaN)
_DEFAULT_NAN = -0x00400000  # 0xffc00000: x86's default NaN (inf - inf, 0 * inf)
_INF = 0x7F800000
_MIN_NORMAL = 0x00800000  # 2**-126, the smallest normal float32
_KEY_NEG_INF = -0x7F800001  # key of -inf (0xff800000): any key below it is a negative NaN
_KEY_POS_INF = 0x7F800000  # key of +inf: any key above it is a positive NaN
# bfloat16 bit patterns (as int16)
_BF16_NAN_POS = 0x7FC0
_BF16_NAN_NEG = -0x0040  # 0xffc0
_BF16_NEG_ZERO = -0x8000  # 0x8000

# Hot loops index with unsigned integers: numba then skips the negative-index wrap-around, which
# otherwise turns vector loads into per-lane inserts.
_U = np.uint64


# ---------------------------------------------------------------------------------------------
# Bit casts and dtype conversions
# ---------------------------------------------------------------------------------------------


@intrinsic
def f32_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """float32 -> its int32 bit pattern (a bitcast, no conversion)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(x), codegen


@intrinsic
def bits_f32(typingctx, v):  # type: ignore[no-untyped-def]
    """int32 bit pattern -> float32 (a bitcast; wider integers are truncated to 32 bits first)."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        val = args[0]
        if v.bitwidth > 32:
            val = builder.trunc(val, ir.IntType(32))
        elif v.bitwidth < 32:
            val = builder.sext(val, ir.IntType(32)) if v.signed else builder.zext(val, ir.IntType(32))
        return builder.bitcast(val, ir.FloatType())

    return types.float32(v), codegen


def _load_bits(v):  # type: ignore[no-untyped-def]  # pragma: no cover - replaced by the overload
    """Raw element (int32 = float32, int16 = bfloat16, uint16 = float16) -> float32 bits (int32)."""
    raise NotImplementedError


@njit(**_JIT)
def _f16_to_f32_bits(v):  # type: ignore[no-untyped-def]
    h = np.int32(v)
    r = np.int32((h & 0x7FFF) << 13)
    # Rebias the exponent by 2**112 (exact, also for subnormal float16, since float32 is wider).
    b = f32_bits(bits_f32(r) * np.float32(5.192296858534828e33))
    if (h & 0x7C00) == 0x7C00:  # inf / NaN: keep the payload
        b = np.int32(r | _INF)
    return np.int32(b | ((h & 0x8000) << 16))


@overload(_load_bits, jit_options=_JIT)
def _ov_load_bits(v):  # type: ignore[no-untyped-def]
    if isinstance(v, types.Integer) and v.bitwidth == 32:
        return lambda v: np.int32(v)
    if isinstance(v, types.Integer) and v.bitwidth == 16 and v.signed:  # bfloat16
        return lambda v: np.int32(np.int32(v) << 16)
    if isinstance(v, types.Integer) and v.bitwidth == 16 and not v.signed:  # float16
        return lambda v: _f16_to_f32_bits(v)
    return None


@njit(**_JIT)
def _f32_to_bf16(b):  # type: ignore[no-untyped-def]
    """float32 bits -> bfloat16 bits, round to nearest even, NaN -> 0xffff (as PyTorch CPU)."""
    lsb = np.int32(np.int32(b >> 16) & 1)
    r = np.int32(np.int32(np.uint32(b) + np.uint32(0x7FFF + lsb)) >> 16)
    return np.int16(r if np.int32(b & 0x7FFFFFFF) <= _INF else np.int32(-1))


@njit(**_JIT)
def _f32_to_f16(b):  # type: ignore[no-untyped-def]
    """float32 bits -> float16 bits, round to nearest even; NaN keeps sign and top payload (F16C).
    Branch-free and in int32 (every case computed, one selected) so that the decode loops vectorise."""
    sign = np.int32(np.int32(b >> 16) & 0x8000)
    a = np.int32(b & 0x7FFFFFFF)
    t = np.int32(a - 0x38000000)  # normal float16: rebias the exponent, round the 13 dropped bits
    r = np.int32(np.int32(t + np.int32(0xFFF + np.int32(np.int32(t >> 13) & 1))) >> 13)
    f = bits_f32(a) * np.float32(16777216.0)  # subnormal float16: value * 2**24 < 1024, exact
    sub = np.int32(f32_bits(f + np.float32(8388608.0)) - 0x4B000000)  # to an integer, ties to even
    r = r if a >= 0x38800000 else sub
    r = r if a < 0x477FF000 else np.int32(0x7C00)  # overflow -> inf
    r = r if a <= _INF else np.int32(0x7E00 | np.int32(np.int32(a >> 13) & 0x3FF))  # NaN
    return np.uint16(r | sign)


def _store_bits(out, i, b):  # type: ignore[no-untyped-def]  # pragma: no cover - replaced by the overload
    """Store float32 bits ``b`` into ``out[i]`` converted to the output dtype (by element type)."""
    raise NotImplementedError


@overload(_store_bits, jit_options=_JIT)
def _ov_store_bits(out, i, b):  # type: ignore[no-untyped-def]
    dt = out.dtype
    if isinstance(dt, types.Integer) and dt.bitwidth == 32:

        def impl(out, i, b):  # type: ignore[no-untyped-def]
            out[i] = b

        return impl
    if isinstance(dt, types.Integer) and dt.bitwidth == 16 and dt.signed:

        def impl(out, i, b):  # type: ignore[no-untyped-def]
            out[i] = _f32_to_bf16(b)

        return impl
    if isinstance(dt, types.Integer) and dt.bitwidth == 16 and not dt.signed:

        def impl(out, i, b):  # type: ignore[no-untyped-def]
            out[i] = _f32_to_f16(b)

        return impl
    return None


# ---------------------------------------------------------------------------------------------
# Stats (per-group min / max / min positive) on order-preserving integer keys
# ---------------------------------------------------------------------------------------------


def _is_f32(a):  # type: ignore[no-untyped-def]  # pragma: no cover - replaced by the overload
    """Whether the array ``a`` holds float32 bit patterns (32-bit integers), at compile time."""
    raise NotImplementedError


@overload(_is_f32, jit_options=_JIT)
def _ov_is_f32(a):  # type: ignore[no-untyped-def]
    f32 = isinstance(a.dtype, types.Integer) and a.dtype.bitwidth == 32
    return (lambda a: True) if f32 else (lambda a: False)


# 16-lane LLVM IR building blocks of the explicit-vector kernels (NOTE [ Explicit vectors ])
_I32, _F32 = ir.IntType(32), ir.FloatType()
_V16I, _V16F, _V16H = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16), ir.VectorType(ir.IntType(16), 16)


def _i32x16(values: int | list[int]) -> ir.Constant:
    """A constant <16 x i32>: one value in every lane, or one value per lane."""
    return ir.Constant(_V16I, values if isinstance(values, list) else [values] * 16)


def _f32x16(value: float) -> ir.Constant:
    return ir.Constant(_V16F, [value] * 16)


def _splat(builder: ir.IRBuilder, x: ir.Value, vt: ir.VectorType) -> ir.Value:
    """``x`` in every lane of a 16-lane vector of type ``vt``."""
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(_V16I, [0] * 16))


def _widen16(builder: ir.IRBuilder, v: ir.Value, bfloat16: bool) -> ir.Value:
    """The float32 bits (<16 x i32>) of 16 bfloat16 (``bfloat16``) or float16 bit patterns (<16 x i16>):
    ``_load_bits``' arithmetic in 16 lanes."""
    ci = _i32x16
    h = builder.zext(v, _V16I)
    if bfloat16:
        return builder.shl(h, ci(16))
    r = builder.shl(builder.and_(h, ci(0x7FFF)), ci(13))
    rebiased = builder.bitcast(builder.fmul(builder.bitcast(r, _V16F), _f32x16(5.192296858534828e33)), _V16I)
    special = builder.icmp_signed("==", builder.and_(h, ci(0x7C00)), ci(0x7C00))  # inf / NaN: keep the payload
    b = builder.select(special, builder.or_(r, ci(_INF)), rebiased)
    return builder.or_(b, builder.shl(builder.and_(h, ci(0x8000)), ci(16)))


def _narrow16(builder: ir.IRBuilder, b: ir.Value, bfloat16: bool) -> ir.Value:
    """16 float32 bit patterns (<16 x i32>) as bfloat16 (``bfloat16``) or float16 bits (<16 x i16>):
    ``_f32_to_bf16`` / ``_f32_to_f16``'s arithmetic in 16 lanes."""
    ci = _i32x16
    a = builder.and_(b, ci(0x7FFFFFFF))
    if bfloat16:
        lsb = builder.and_(builder.lshr(b, ci(16)), ci(1))
        r = builder.lshr(builder.add(b, builder.add(ci(0x7FFF), lsb)), ci(16))
        r = builder.select(builder.icmp_signed("<=", a, ci(_INF)), r, ci(0xFFFF))
        return builder.trunc(r, _V16H)
    sign = builder.and_(builder.lshr(b, ci(16)), ci(0x8000))
    t = builder.sub(a, ci(0x38000000))
    r = builder.ashr(builder.add(t, builder.add(ci(0xFFF), builder.and_(builder.ashr(t, ci(13)), ci(1)))), ci(13))
    f = builder.fmul(builder.bitcast(a, _V16F), _f32x16(16777216.0))
    sub = builder.sub(builder.bitcast(builder.fadd(f, _f32x16(8388608.0)), _V16I), ci(0x4B000000))
    r = builder.select(builder.icmp_signed(">=", a, ci(0x38800000)), r, sub)
    r = builder.select(builder.icmp_signed("<", a, ci(0x477FF000)), r, ci(0x7C00))
    nan = builder.or_(ci(0x7E00), builder.and_(builder.ashr(a, ci(13)), ci(0x3FF)))
    r = builder.select(builder.icmp_signed("<=", a, ci(_INF)), r, nan)
    return builder.trunc(builder.or_(r, sign), _V16H)


def _load16(builder: ir.IRBuilder, element: types.Integer, data: ir.Value, i: ir.Value, count: int) -> list[ir.Value]:
    """``count`` vectors of 16 values from ``data[i]`` on (int32 float32 bits, int16 bfloat16 or uint16
    float16 bits, by ``element``), as they are: <16 x i32> or <16 x i16>."""
    vt = _V16I if element.bitwidth == 32 else _V16H
    src = builder.bitcast(builder.gep(data, [i]), vt.as_pointer())
    return [builder.load(builder.gep(src, [ir.Constant(_I32, j)]), align=element.bitwidth // 8) for j in range(count)]


def _as_f32_bits(builder: ir.IRBuilder, element: types.Integer, v: ir.Value) -> ir.Value:
    """What ``_load16`` loaded as float32 bits (<16 x i32>)."""
    return v if element.bitwidth == 32 else _widen16(builder, v, element.signed)


@intrinsic
def _stats16(typingctx, xb, a, n16):  # type: ignore[no-untyped-def]
    """(min key, max key, min positive bits) of the values ``xb[a:a + 16 * n16]`` (float32 as int32 bits,
    bfloat16 as int16, float16 as uint16) as explicit 16-lane vectors, ``_stats_range``'s arithmetic; see
    ``NOTE [ Explicit vectors ]``."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        x_a = context.make_array(sig.args[0])(context, builder, args[0])
        element = sig.args[0].dtype
        ci, v16i = _i32x16, _V16I
        kmin_p = cgutils.alloca_once_value(builder, ci(0x7FFFFFFF))
        kmax_p = cgutils.alloca_once_value(builder, ci(-0x80000000))
        pmin_p = cgutils.alloca_once_value(builder, ci(_INF))
        with cgutils.for_range(builder, args[2]) as loop:
            i = builder.add(args[1], builder.mul(loop.index, ir.Constant(loop.index.type, 16)))
            v = _as_f32_bits(builder, element, _load16(builder, element, x_a.data, i, 1)[0])
            k = builder.xor(v, builder.and_(builder.ashr(v, ci(31)), ci(0x7FFFFFFF)))
            kmin, kmax = builder.load(kmin_p), builder.load(kmax_p)
            builder.store(builder.select(builder.icmp_signed("<", k, kmin), k, kmin), kmin_p)
            builder.store(builder.select(builder.icmp_signed(">", k, kmax), k, kmax), kmax_p)
            # 0 < v <= +inf bits: a positive value (NaN and zeros excluded)
            p = builder.select(builder.icmp_unsigned("<", builder.sub(v, ci(1)), ci(_INF)), v, ci(_INF))
            pmin = builder.load(pmin_p)
            builder.store(builder.select(builder.icmp_signed("<", p, pmin), p, pmin), pmin_p)
        out = []
        for name, ptr in (("smin", kmin_p), ("smax", kmax_p), ("smin", pmin_p)):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v16i]),
                                                f"llvm.vector.reduce.{name}.v16i32")
            out.append(builder.call(fn, [builder.load(ptr)]))
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(types.int32, 3)(xb, a, n16), codegen


@njit(inline="always", **_JIT)
def _stats_range(xb, a, b):  # type: ignore[no-untyped-def]
    """(min key, max key, min positive bits) of ``xb[a:b]``; identities for an empty range."""
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    pmin = np.int32(_INF)
    if b - a >= 16:
        n16 = (b - a) // 16
        kmin, kmax, pmin = _stats16(xb, _U(a), _U(n16))
        a += 16 * n16
    for i in range(a, b):
        v = _load_bits(xb[_U(i)])
        k = np.int32(v ^ ((v >> 31) & 0x7FFFFFFF))
        kmin = k if k < kmin else kmin
        kmax = k if k > kmax else kmax
        # 0 < v <= +inf bits: a positive value (NaN and zeros excluded), as torch.where(x > 0, x, inf).
        p = v if np.uint32(v - 1) < np.uint32(_INF) else np.int32(_INF)
        pmin = p if p < pmin else pmin
    return kmin, kmax, pmin


@njit(inline="always", **_JIT)
def _keys_to_stats(kmin, kmax, pmin):  # type: ignore[no-untyped-def]
    """Min-key, max-key, min-positive -> float32 bits (min, max, min positive); NaN -> canonical."""
    if kmin < _KEY_NEG_INF or kmax > _KEY_POS_INF:
        return np.int32(_NAN), np.int32(_NAN), np.int32(pmin)
    mn = np.int32(kmin ^ ((kmin >> 31) & 0x7FFFFFFF))
    mx = np.int32(kmax ^ ((kmax >> 31) & 0x7FFFFFFF))
    return mn, mx, np.int32(pmin)


@njit(**_JIT)
def _bf16_round_up(step):  # type: ignore[no-untyped-def]
    """float32 -> bfloat16 bits rounded up (reference ``_bf16_round_up``, on int64 like it)."""
    b = np.int64(f32_bits(step))
    if (b & 0x7FFFFFFF) < _INF:
        return np.int16((b + 0xFFFF) >> 16)
    return np.int16(b >> 16)


@njit(inline="always", **_JIT)
def _flush_tiny(step):  # type: ignore[no-untyped-def]
    """A positive subnormal step -> 0 (``NOTE [ Tiny steps ]`` in ``reference.py``), compared on bits."""
    b = f32_bits(step)
    return np.float32(0.0) if (b > 0 and b < _MIN_NORMAL) else step


@njit(inline="always", **_JIT)
def _params(mn_b, mx_b, mp_b, bits):  # type: ignore[no-untyped-def]
    """Stats bits -> (lo float32 bits, scale bfloat16 bits), as ``reference.group_params``."""
    mn = bits_f32(mn_b)
    mx = bits_f32(mx_b)
    mp = bits_f32(mp_b)
    levels = (1 << bits) - 1
    if mn == 0 and mx > 0:  # zero-exact (no NaN in the group, mn is a zero)
        if levels >= 2:
            if mp_b == _INF:  # only +inf positives: (inf - inf) is 0xffc00000; -bf16 NaN gives 0x7fc0
                return mp_b, np.int16(_BF16_NAN_POS)
            step = _flush_tiny((mx - mp) / np.float32(levels - 1))
            return mp_b, np.int16(_bf16_round_up(step) | _BF16_NEG_ZERO)
        lo = (mp + mx) * np.float32(0.5)
        return f32_bits(lo), np.int16(_BF16_NEG_ZERO)
    if mn != mn:  # NaN group: lo is the canonical NaN, (NaN - NaN) / L keeps it: bf16 0x7fc0
        return mn_b, np.int16(_BF16_NAN_POS)
    if mn_b == mx_b and (mn_b & 0x7FFFFFFF) == _INF:  # all +inf or all -inf: inf - inf = 0xffc00000
        return mn_b, np.int16(_BF16_NAN_NEG)
    step = _flush_tiny((mx - mn) / np.float32(levels))
    return mn_b, _bf16_round_up(step)


@njit(**_JIT)
def _scale_step(sb):  # type: ignore[no-untyped-def]
    """bfloat16 scale bits -> (|scale| as float32, zero-exact flag)."""
    s = np.int32(sb)
    return bits_f32(np.int32((s << 16) & 0x7FFFFFFF)), (s & 0x8000) != 0


# ---------------------------------------------------------------------------------------------
# Quantize: codes of a range of values into a uint8 buffer
# ---------------------------------------------------------------------------------------------


@njit(**_JIT)
def _noise(i, seed):  # type: ignore[no-untyped-def]
    """u = (fmix32((i mod 2**32) ^ seed) >> 8) * 2**-24 as float32 (exact)."""
    h = np.uint32(np.uint32(i) ^ seed)
    h = np.uint32(h ^ (h >> np.uint32(16)))
    h = np.uint32(h * np.uint32(0x85EBCA6B))
    h = np.uint32(h ^ (h >> np.uint32(13)))
    h = np.uint32(h * np.uint32(0xC2B2AE35))
    h = np.uint32(h ^ (h >> np.uint32(16)))
    return np.float32(np.int32(h >> np.uint32(8))) * np.float32(5.9604644775390625e-08)


@njit(**_JIT)
def _codes_range(xb, a, b, lo_b, sb, bits, seed, dst):  # type: ignore[no-untyped-def]
    """Codes (int32) of values ``a:b`` (global flat indices) into ``dst[0:b - a]``."""
    lo = bits_f32(lo_b)
    step, zero_exact = _scale_step(sb)
    inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
    levels = np.float32((1 << bits) - 1)
    if zero_exact:
        top = levels - np.float32(1.0)
        for i in range(a, b):
            x = bits_f32(_load_bits(xb[_U(i)]))
            r = np.floor((x - lo) * inv + _noise(i, seed))
            c = top if top < r else r  # (x86 minps/maxps shapes: NaN stays NaN here ...
            c = c if c > 0 else np.float32(0.0)  # ... and becomes 0 here)
            dst[_U(i - a)] = np.int32(0) if ((x == 0) | (r != r)) else np.int32(c) + np.int32(1)
    else:
        for i in range(a, b):
            x = bits_f32(_load_bits(xb[_U(i)]))
            r = np.floor((x - lo) * inv + _noise(i, seed))
            c = levels if levels < r else r  # clamp to [0, L]; NaN stays NaN here ...
            c = c if c > 0 else np.float32(0.0)  # ... and becomes 0 here, as PyTorch's float -> uint8
            dst[_U(i - a)] = np.int32(c)


@njit(**_JIT)
def _pack_words(src, count, bits, out, w0):  # type: ignore[no-untyped-def]
    """Pack ``count`` int32 codes (a multiple of 8) into words of 8 codes (``out``'s dtype has
    ``8 * bits`` bits) from ``out[w0]``: code ``s`` of a word at bits ``bits * s``, LSB first."""
    for k in range(count // 8):
        j = _U(8 * k)
        w0_ = src[j] | (src[j + _U(1)] << bits)
        w1_ = src[j + _U(2)] | (src[j + _U(3)] << bits)
        w2_ = src[j + _U(4)] | (src[j + _U(5)] << bits)
        w3_ = src[j + _U(6)] | (src[j + _U(7)] << bits)
        w0_ = w0_ | (w1_ << (2 * bits))
        w2_ = w2_ | (w3_ << (2 * bits))
        out[_U(w0 + k)] = w0_ | (w2_ << (4 * bits))


@njit(**_JIT)
def _word_views(codes):  # type: ignore[no-untyped-def]
    """uint16 / uint32 / uint64 views of the flat uint8 ``codes`` (made once per task, not per group)."""
    n = codes.shape[0]
    return codes[: n - n % 2].view(np.uint16), codes[: n - n % 4].view(np.uint32), codes[: n - n % 8].view(np.uint64)


def _deinterleave(builder, vectors, offsets):  # type: ignore[no-untyped-def]
    """Split 16-lane ``vectors`` (lane offsets ``offsets``: Python lists) into their even and odd
    lanes, recursively, until there are as many vectors as the input had: vector ``j`` of the result
    holds every ``len(vectors)``-th value. Returns (vectors, offsets)."""
    if len(vectors) == 1:
        return vectors, offsets
    halves: list[tuple[list, list]] = []
    for parity in (0, 1):
        lanes = _i32x16([2 * k + parity for k in range(16)])
        vs, offs = [], []
        for p in range(0, len(vectors), 2):
            vs.append(builder.shuffle_vector(vectors[p], vectors[p + 1], lanes))
            both = offsets[p] + offsets[p + 1]
            offs.append([both[2 * k + parity] for k in range(16)])
        halves.append(_deinterleave(builder, vs, offs))
    return halves[0][0] + halves[1][0], halves[0][1] + halves[1][1]


def _make_quant_bytes(bits: int, zero_exact: bool, grid: bool = False):  # type: ignore[no-untyped-def]
    """An intrinsic quantizing ``nruns`` runs of ``128 / bits`` values from ``xb[i]`` (float32 as int32
    bits, bfloat16 as int16, float16 as uint16) to ``bits``-bit codes with the reference's stochastic
    rounding, each run packed into 16 bytes, from ``codes[o]`` on, as explicit 16-lane vectors; see ``NOTE
    [ Explicit vectors ]``. With ``grid`` (plain groups), onto the fitted grid and widths of its last two
    arguments (``NOTE [ Grid kernels without gathers ]``)."""
    nvec = 8 // bits  # codes per byte: vector j holds the values at j, j + nvec, j + 2 nvec, ...

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        with cgutils.for_range(builder, args[2]) as loop:
            run_i = builder.add(args[1], builder.mul(loop.index, ir.Constant(args[1].type, 128 // bits)))
            run_o = builder.add(args[8], builder.mul(loop.index, ir.Constant(args[8].type, 16)))
            run(context, builder, sig, [args[0], run_i, *args[3:8], run_o, *args[9:]])
        return context.get_dummy_value()

    def run(context, builder, sig, args):  # type: ignore[no-untyped-def]
        x_a = context.make_array(sig.args[0])(context, builder, args[0])
        c_a = context.make_array(sig.args[7])(context, builder, args[6])
        if grid:
            g_a = context.make_array(sig.args[9])(context, builder, args[8])
            w_a = context.make_array(sig.args[10])(context, builder, args[9])
        i32, v16i, v16f, v16b = _I32, _V16I, _V16F, ir.VectorType(ir.IntType(8), 16)
        ci, cf = _i32x16, _f32x16
        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f]), "llvm.floor.v16f32")

        def splat(x, vt):  # type: ignore[no-untyped-def]
            return _splat(builder, x, vt)

        element = sig.args[0].dtype
        loaded = _load16(builder, element, x_a.data, args[1], nvec)
        xs, offsets = _deinterleave(builder, loaded, [list(range(16 * j, 16 * j + 16)) for j in range(nvec)])
        xs = [_as_f32_bits(builder, element, v) for v in xs]
        lo_v, inv_v, seed_v = splat(args[2], v16f), splat(args[3], v16f), splat(builder.trunc(args[5], i32), v16i)
        i_v = splat(builder.trunc(args[1], i32), v16i)
        top = builder.fsub(splat(args[4], v16f), cf(1.0)) if zero_exact else splat(args[4], v16f)
        if grid:
            grid_values = [builder.load(builder.gep(g_a.data, [ir.Constant(i32, j)])) for j in range(1 << bits)]
            width_values = [builder.load(builder.gep(w_a.data, [ir.Constant(i32, j)])) for j in range(1 << bits)]
        packed = None
        for xi, off in zip(xs, offsets, strict=True):
            x = builder.bitcast(xi, v16f)
            # noise: fmix32((i + offset) mod 2**32 ^ seed) >> 8, times 2**-24 (``_noise``)
            h = builder.xor(builder.add(i_v, ci(off)), seed_v)
            h = builder.xor(h, builder.lshr(h, ci(16)))
            h = builder.mul(h, ci(0x85EBCA6B - (1 << 32)))
            h = builder.xor(h, builder.lshr(h, ci(13)))
            h = builder.mul(h, ci(0xC2B2AE35 - (1 << 32)))
            h = builder.xor(h, builder.lshr(h, ci(16)))
            u = builder.fmul(builder.sitofp(builder.lshr(h, ci(8)), v16f), cf(5.9604644775390625e-08))
            t = builder.fmul(builder.fsub(x, lo_v), inv_v)
            if grid:  # k + (t - g[k]) * w[k], g[k] and w[k] by selects (NOTE [ Grid kernels without gathers ])
                k, below, width = cf(0.0), splat(grid_values[0], v16f), splat(width_values[0], v16f)
                for j in range(1, (1 << bits) - 1):
                    level = splat(grid_values[j], v16f)
                    above = builder.fcmp_ordered(">=", t, level)
                    k = builder.select(above, cf(float(j)), k)
                    below = builder.select(above, level, below)
                    width = builder.select(above, splat(width_values[j], v16f), width)
                t = builder.fadd(k, builder.fmul(builder.fsub(t, below), width))
            r = builder.call(floor, [builder.fadd(t, u)])
            c = builder.select(builder.fcmp_ordered("<", top, r), top, r)  # clamp; NaN stays NaN ...
            c = builder.select(builder.fcmp_ordered(">", c, cf(0.0)), c, cf(0.0))  # ... and becomes 0
            code = builder.fptosi(c, v16i)
            if zero_exact:
                special = builder.or_(builder.fcmp_ordered("==", x, cf(0.0)), builder.fcmp_unordered("uno", r, r))
                code = builder.select(special, ci(0), builder.add(code, ci(1)))
            # lane k of vector j is code j of byte k: shift it to bits * j and OR the vectors
            shifted = builder.shl(code, ci(bits * off[0])) if off[0] else code
            packed = shifted if packed is None else builder.or_(packed, shifted)
        dst = builder.bitcast(builder.gep(c_a.data, [args[7]]), v16b.as_pointer())
        builder.store(builder.trunc(packed, v16b), dst, align=1)

    if grid:
        @intrinsic
        def quant_grid_bytes(typingctx, xb, i, nruns, lo, inv, levels, seed, codes, o, grid_values,  # type: ignore[no-untyped-def]
                             widths):
            return types.none(xb, i, nruns, lo, inv, levels, seed, codes, o, grid_values, widths), codegen

        return quant_grid_bytes

    @intrinsic
    def quant_bytes(typingctx, xb, i, nruns, lo, inv, levels, seed, codes, o):  # type: ignore[no-untyped-def]
        return types.none(xb, i, nruns, lo, inv, levels, seed, codes, o), codegen

    return quant_bytes


_QUANT_1, _QUANT_1Z = _make_quant_bytes(1, False), _make_quant_bytes(1, True)
_QUANT_2, _QUANT_2Z = _make_quant_bytes(2, False), _make_quant_bytes(2, True)
_QUANT_4, _QUANT_4Z = _make_quant_bytes(4, False), _make_quant_bytes(4, True)
_QUANT_8, _QUANT_8Z = _make_quant_bytes(8, False), _make_quant_bytes(8, True)
_QUANT_2G, _QUANT_4G = _make_quant_bytes(2, False, grid=True), _make_quant_bytes(4, False, grid=True)


@njit(inline="always", **_JIT)
def _quantize_runs(xb, a, nruns, lo_b, sb, bits, seed, codes, o0):  # type: ignore[no-untyped-def]
    """Codes of ``nruns`` runs of ``128 / bits`` values from ``a``, 16 bytes each, packed into ``codes`` from
    byte ``o0``."""
    lo = bits_f32(lo_b)
    step, zero_exact = _scale_step(sb)
    inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
    levels = np.float32((1 << bits) - 1)
    args = (xb, _U(a), _U(nruns), lo, inv, levels, seed, codes, _U(o0))
    if bits == 1:
        _QUANT_1Z(*args) if zero_exact else _QUANT_1(*args)
    elif bits == 2:
        _QUANT_2Z(*args) if zero_exact else _QUANT_2(*args)
    elif bits == 4:
        _QUANT_4Z(*args) if zero_exact else _QUANT_4(*args)
    else:
        _QUANT_8Z(*args) if zero_exact else _QUANT_8(*args)


@njit(inline="always", **_JIT)
def _quantize_span(  # type: ignore[no-untyped-def]
    xb, n, a, stop, lo_b, sb, bits, seed, scratch, codes, c16, c32, o0
):
    """Codes of the values ``a:stop`` (``stop - a`` a multiple of 32, values past ``n`` padding)
    packed into the flat uint8 ``codes`` (``c16``, ``c32``: its word views) from byte ``o0``."""
    b = max(a, min(n, stop))
    nruns = (b - a) // (128 // bits)  # runs of 16 bytes of codes as explicit vectors, the rest below
    _quantize_runs(xb, a, nruns, lo_b, sb, bits, seed, codes, o0)
    a += nruns * (128 // bits)
    o0 += 16 * nruns
    if a == stop:
        return
    count = stop - a
    _codes_range(xb, a, b, lo_b, sb, bits, seed, scratch)
    for k in range(b - a, count):
        scratch[_U(k)] = 0
    if bits == 1:
        _pack_words(scratch, count, 1, codes, o0)
    elif bits == 2:
        _pack_words(scratch, count, 2, c16, o0 // 2)
    elif bits == 4:
        _pack_words(scratch, count, 4, c32, o0 // 4)
    else:
        for k in range(count):
            codes[_U(o0 + k)] = np.uint8(scratch[_U(k)])


# NOTE [ Grid kernels without gathers ]
# On a fitted grid (``layout.py``) a value's level below and its width, and a code's level, depend on the
# value: indexing the grid by a computed ``k`` or code is a gather, which kept numba's loops scalar and
# made them several times slower than the uniform grid's. The kernels pick them with one compare and
# select per level instead, in the explicit vectors of ``NOTE [ Explicit vectors ]``
# (``_make_quant_bytes(..., grid=True)``, ``_make_grid_store16``): the grid ascends, so the last level at
# or below ``t`` wins. The arithmetic is the reference's, operation for operation. The scalar
# ``_grid_position`` does the same for the tails of groups and the column kernels.
@njit(inline="always", **_JIT)
def _grid_position(t, grid, widths, inner):  # type: ignore[no-untyped-def]
    """``k + (t - g[k]) * w[k]`` with ``k`` the number of ``g[1..inner]`` at or below ``t``."""
    k = np.float32(0.0)
    below = grid[0]
    width = widths[0]
    for j in range(1, inner + 1):
        above = t >= grid[j]
        k = np.float32(j) if above else k
        below = grid[j] if above else below
        width = widths[j] if above else width
    return k + (t - below) * width


@njit(inline="always", **_JIT)
def _grid_codes(xb, a, b, lo, inv, seed, grid, widths, dst, inner):  # type: ignore[no-untyped-def]
    levels = np.float32(inner + 1)
    for i in range(a, b):
        x = bits_f32(_load_bits(xb[_U(i)]))
        r = np.floor(_grid_position((x - lo) * inv, grid, widths, inner) + _noise(i, seed))
        c = levels if levels < r else r
        c = c if c > 0 else np.float32(0.0)
        dst[_U(i - a)] = np.int32(c)


@njit(**_JIT)
def _codes_range_grid(xb, a, b, lo, inv, bits, seed, grid, widths, dst):  # type: ignore[no-untyped-def]
    """Codes (int32) of values ``a:b`` of a plain group with finite lo and step, on the fitted ``grid``."""
    if bits == 2:
        _grid_codes(xb, a, b, lo, inv, seed, grid, widths, dst, 2)
    else:
        _grid_codes(xb, a, b, lo, inv, seed, grid, widths, dst, 14)


@njit(inline="always", **_JIT)
def _quantize_span_grid(  # type: ignore[no-untyped-def]
    xb, n, a, stop, lo_b, sb, bits, seed, grid, widths, scratch, codes, c16, c32, o0
):
    """``_quantize_span`` on the fitted ``grid``: plain groups with finite lo and step round onto it, the
    others as without a grid (``layout.py``)."""
    lo = bits_f32(lo_b)
    step, zero_exact = _scale_step(sb)
    if zero_exact or not (np.isfinite(lo) and np.isfinite(step)):
        _quantize_span(xb, n, a, stop, lo_b, sb, bits, seed, scratch, codes, c16, c32, o0)
        return
    inv = np.float32(1.0) / step if step > 0 else np.float32(0.0)
    b = max(a, min(n, stop))
    nruns = (b - a) // (128 // bits)  # runs of 16 bytes of codes as explicit vectors, the rest below
    levels = np.float32((1 << bits) - 1)
    args = (xb, _U(a), _U(nruns), lo, inv, levels, seed, codes, _U(o0), grid, widths)
    _QUANT_2G(*args) if bits == 2 else _QUANT_4G(*args)
    a += nruns * (128 // bits)
    o0 += 16 * nruns
    if a == stop:
        return
    count = stop - a
    _codes_range_grid(xb, a, b, lo, inv, bits, seed, grid, widths, scratch)
    for k in range(b - a, count):
        scratch[_U(k)] = 0
    if bits == 2:
        _pack_words(scratch, count, 2, c16, o0 // 2)
    else:
        _pack_words(scratch, count, 4, c32, o0 // 4)


# ---------------------------------------------------------------------------------------------
# Parallel kernels
# ---------------------------------------------------------------------------------------------


@njit(**_PJIT)
def _minmax_per_group(xb, n, group_size, out, nchunks):  # type: ignore[no-untyped-def]
    """Strategy ``per_group``: stats of whole groups, parallel over runs of groups. out int32 [ng, 3]."""
    ng = out.shape[0]
    per = (ng + nchunks - 1) // nchunks
    for ci in prange(nchunks):
        for g in range(ci * per, min(ng, (ci + 1) * per)):
            a = g * group_size
            kmin, kmax, pmin = _stats_range(xb, a, min(n, a + group_size))
            mn, mx, mp = _keys_to_stats(kmin, kmax, pmin)
            out[g, 0] = mn
            out[g, 1] = mx
            out[g, 2] = mp


@njit(**_PJIT)
def _minmax_two_level(xb, n, group_size, tile, out):  # type: ignore[no-untyped-def]
    """Strategy ``two_level``: partial stats per tile of ``tile`` values inside the groups, in parallel,
    then one exact combine per group. out int32 [ng, 3]."""
    ng = out.shape[0]
    tpg = (group_size + tile - 1) // tile
    nt = ng * tpg
    part = np.empty((nt, 3), np.int32)
    for t in prange(nt):
        g = t // tpg
        a = g * group_size + (t % tpg) * tile
        stop = min(min(n, (g + 1) * group_size), a + tile)
        kmin, kmax, pmin = _stats_range(xb, a, max(a, stop))
        part[t, 0] = kmin
        part[t, 1] = kmax
        part[t, 2] = pmin
    for g in prange(ng):
        kmin = part[g * tpg, 0]
        kmax = part[g * tpg, 1]
        pmin = part[g * tpg, 2]
        for t in range(g * tpg + 1, (g + 1) * tpg):
            kmin = min(kmin, part[t, 0])
            kmax = max(kmax, part[t, 1])
            pmin = min(pmin, part[t, 2])
        mn, mx, mp = _keys_to_stats(kmin, kmax, pmin)
        out[g, 0] = mn
        out[g, 1] = mx
        out[g, 2] = mp


@njit(**_JIT)
def _grid_widths(grid):  # type: ignore[no-untyped-def]
    """``reference.grid_widths`` of a fitted grid's float32 values (none for an empty grid), computed where
    the kernel starts: a few values, cheaper here than any array call on the host."""
    widths = np.empty(max(grid.shape[0] - 1, 0), np.float32)
    for k in range(widths.shape[0]):
        widths[k] = np.float32(1.0) / (grid[k + 1] - grid[k])
    return widths


@njit(**_PJIT)
def _quantize_per_group(  # type: ignore[no-untyped-def]
    xb, n, group_size, bits, seed, grid, codes, lo_out, scale_out, nchunks
):
    """Fused: stats, params, codes and packing of each group in one visit, parallel over runs of groups; on
    the fitted ``grid`` unless it is empty."""
    widths = _grid_widths(grid)
    ng = lo_out.shape[0]
    nbytes = group_size * bits // 8
    per = (ng + nchunks - 1) // nchunks
    for ci in prange(nchunks):
        scratch = np.empty(group_size, np.int32)
        c16, c32, _ = _word_views(codes)
        for g in range(ci * per, min(ng, (ci + 1) * per)):
            a = g * group_size
            kmin, kmax, pmin = _stats_range(xb, a, min(n, a + group_size))
            mn, mx, mp = _keys_to_stats(kmin, kmax, pmin)
            lo_b, sb = _params(mn, mx, mp, bits)
            lo_out[g] = lo_b
            scale_out[g] = sb
            if grid.shape[0]:
                _quantize_span_grid(xb, n, a, a + group_size, lo_b, sb, bits, seed, grid, widths, scratch, codes,
                                    c16, c32, g * nbytes)
            else:
                _quantize_span(xb, n, a, a + group_size, lo_b, sb, bits, seed, scratch, codes, c16, c32, g * nbytes)


@njit(**_JIT)
def _params_all(stats, bits, lo_out, scale_out):  # type: ignore[no-untyped-def]
    for g in range(stats.shape[0]):
        lo_b, sb = _params(stats[g, 0], stats[g, 1], stats[g, 2], bits)
        lo_out[g] = lo_b
        scale_out[g] = sb


@njit(**_PJIT)
def _quantize_tiles(xb, n, group_size, bits, seed, tile, lo_b, scale_b, codes):  # type: ignore[no-untyped-def]
    """Codes of tiles of ``tile`` values (a multiple of 32) inside groups whose params are known."""
    ng = lo_b.shape[0]
    tpg = (group_size + tile - 1) // tile
    nbytes = group_size * bits // 8
    for t in prange(ng * tpg):
        g = t // tpg
        off = (t % tpg) * tile
        a = g * group_size + off
        stop = min((g + 1) * group_size, a + tile)
        scratch = np.empty(stop - a, np.int32)
        c16, c32, _ = _word_views(codes)
        o0 = g * nbytes + off * bits // 8
        _quantize_span(xb, n, a, stop, lo_b[g], scale_b[g], bits, seed, scratch, codes, c16, c32, o0)


@njit(**_JIT)
def _decode_special(c, lo, step, zero_exact):  # type: ignore[no-untyped-def]
    """Decode one code of a group with a non-finite lo or step, with the reference's NaN on x86:
    a NaN operand propagates (quieted; the second one if both are NaN), an invalid operation
    (0 * inf, inf - inf) gives the default NaN 0xffc00000."""
    if zero_exact and c == 0:
        return np.int32(0)
    k = np.float32(c) - (np.float32(1.0) if zero_exact else np.float32(0.0))
    if step != step:
        prod_b = np.int32(f32_bits(step) | 0x00400000)
    elif k == 0 and (f32_bits(step) & 0x7FFFFFFF) == _INF:
        prod_b = np.int32(_DEFAULT_NAN)
    else:
        prod_b = f32_bits(k * step)
    prod = bits_f32(prod_b)
    if prod != prod:
        return prod_b
    if lo != lo:
        return np.int32(f32_bits(lo) | 0x00400000)
    lo_b = f32_bits(lo)
    if (lo_b & 0x7FFFFFFF) == _INF and (prod_b & 0x7FFFFFFF) == _INF and lo_b != prod_b:
        return np.int32(_DEFAULT_NAN)
    return f32_bits(lo + prod)


# NOTE [ Explicit vectors ]
# numba's LLVM auto-vectorised a word-at-a-time decode well for plain groups, but not the zero-exact
# branch (code 0 -> exactly 0, else ``lo + (c - 1) * step``): a ReLU output decoded several times slower
# than plain values of the same size. The decode therefore builds the vectors itself: ``_make_store16``
# emits LLVM IR over 16 lanes (splat the 1-4 words that hold 16 codes, shift each lane by its code's
# offset, mask, convert, multiply, add, select the zeros, one store), so both kinds of group run at the
# same speed, close to the output's write limit. The arithmetic is the reference's, operation for
# operation (``lo + float(c) * step``, no fused multiply-add), so the bytes are unchanged; groups with a
# non-finite lo or step keep a scalar loop. float16 and bfloat16 take the same vectors: their values are
# widened to float32 bits on load and narrowed on store in 16 lanes (``_widen16``, ``_narrow16``), the
# integer arithmetic of the scalar conversions (``_load_bits``, ``_store_bits``), so every dtype runs the
# same kernels; a scalar loop over 16-bit values (the fitted grid's per-level selects, above all) was
# several times slower than the vectors.
# ``quantize_pack`` does the same, at every bit-width. ``_stats16`` takes the group's min
# key, max key and min positive over 16 lanes (numba's loop used 8). ``_make_quant_bytes`` fills 16
# bytes of codes per call: it loads the ``128 / bits`` values and de-interleaves them with shuffles so
# that lane k of vector j holds value ``8 / bits * k + j``; after the noise hash, rounding and clamping
# in 16 lanes, code j of every byte then sits in vector j, and the bytes are the vectors shifted by
# ``bits * j``, OR-ed and truncated to 8 bits, one 16-byte store (no reduction across lanes, which
# would cost as much as the noise hash). The per-group helpers are inlined, as in
# ``NOTE [ Inlined group decode ]``.
# The decode takes ``zero_exact`` as a run-time operand (a select that costs nothing measurable in a
# write-bound loop); quantize has an intrinsic per (bits, zero_exact), since the same run-time operand
# slows that compute-bound loop down. The figures are in benchmarks/results/kernels.json and
# kernels_relu.json; docs/kernels.md explains them and how to reproduce them.


# NOTE [ Streaming stores ]
# A decode reads a few bits per value and writes the whole output. Into memory that is not in cache,
# every 64-byte store first reads its line (write-allocate), so a large decode moves twice the bytes
# it writes. From ``STREAMING_BYTES`` on, the float32 decode stores non-temporally (``movntdq``: the
# line goes to memory without being read or kept in cache), then fences once per task. Below that
# size the output stays in cache for its reader (backward sums it right away), and the cached store
# wins; the measurements behind the threshold are in docs/kernels.md (``streaming_stores`` rows of
# benchmarks/results/kernels.json). The stores need 64-byte alignment: the output's start (checked by
# ``streams``) and every 16-value run (groups and tiles are multiples of 32 values).
STREAMING_BYTES = 32 << 20


def streams(out: torch.Tensor) -> bool:
    """Whether ``unpack_dequantize_into`` writes ``out`` with non-temporal stores."""
    return out.dtype == torch.float32 and out.numel() * 4 >= STREAMING_BYTES and out.data_ptr() % 64 == 0


@intrinsic
def _store_fence(typingctx):  # type: ignore[no-untyped-def]
    """A full memory fence: orders the non-temporal stores before the task ends."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


def _codes16(builder: ir.IRBuilder, words: ir.Value, w: ir.Value, bits: int, first: int) -> ir.Value:
    """The 16 codes ``first`` to ``first + 15`` counted from word ``w`` of ``words`` (little-endian 32-bit
    words) as a <16 x i32>."""
    wk = ir.VectorType(_I32, max(1, (first + 16) * bits // 32))
    loaded = builder.load(builder.bitcast(builder.gep(words, [w]), wk.as_pointer()), align=4)
    lanes = builder.shuffle_vector(loaded, ir.Constant(wk, ir.Undefined),
                                   ir.Constant(_V16I, [(first + k) * bits // 32 for k in range(16)]))
    shifts = ir.Constant(_V16I, [((first + k) * bits) % 32 for k in range(16)])
    return builder.and_(builder.lshr(lanes, shifts), ir.Constant(_V16I, [(1 << bits) - 1] * 16))


def _store16(builder: ir.IRBuilder, element: types.Integer, out: ir.Value, o: ir.Value, values: ir.Value,
             streaming: ir.Value) -> None:
    """Store the float32 bits ``values`` (<16 x i32>) at ``out[o:o + 16]``, converted to ``out``'s ``element``
    (int32: float32, int16: bfloat16, uint16: float16); float32 non-temporally if ``streaming`` is set."""
    if element.bitwidth == 16:
        dst = builder.bitcast(builder.gep(out, [o]), _V16H.as_pointer())
        builder.store(_narrow16(builder, values, element.signed), dst, align=2)
        return
    dst = builder.bitcast(builder.gep(out, [o]), _V16I.as_pointer())
    is_streaming = builder.icmp_unsigned("!=", streaming, ir.Constant(streaming.type, 0))
    with builder.if_else(is_streaming) as (stream, cached):
        with stream:
            store = builder.store(values, dst, align=64)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
        with cached:
            builder.store(values, dst, align=4)


def _make_store16(bits: int, first: int = 0):  # type: ignore[no-untyped-def]
    """An intrinsic decoding 16 codes of ``bits`` of a group (zero-exact or not, ``zero_exact``) from
    little-endian 32-bit words (codes ``first`` to ``first + 15`` counted from word ``w``) into
    ``out[o:o + 16]`` (``_store16``), as one explicit 16-lane vector; see ``NOTE [ Explicit vectors ]``.
    With ``streaming`` the store is non-temporal and ``out + o`` must be 64-byte aligned
    (``NOTE [ Streaming stores ]``)."""

    @intrinsic
    def store16(typingctx, out, o, words, w, lo, step, zero_exact, streaming):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            out_a = context.make_array(sig.args[0])(context, builder, args[0])
            words_a = context.make_array(sig.args[2])(context, builder, args[2])
            v16i, v16f = _V16I, _V16F
            c = _codes16(builder, words_a.data, args[3], bits, first)

            def splat(x, vt=v16f):  # type: ignore[no-untyped-def]
                return _splat(builder, x, vt)

            zx = builder.icmp_unsigned("!=", args[6], ir.Constant(args[6].type, 0))
            zx_v = splat(zx, ir.VectorType(ir.IntType(1), 16))
            k = builder.sub(c, builder.zext(zx_v, v16i))  # a zero-exact group spends code 0 on zeros
            v = builder.fadd(splat(args[4]), builder.fmul(builder.sitofp(k, v16f), splat(args[5])))
            is0 = builder.and_(builder.icmp_unsigned("==", c, ir.Constant(v16i, [0] * 16)), zx_v)
            vb = builder.select(is0, ir.Constant(v16i, [0] * 16), builder.bitcast(v, v16i))
            _store16(builder, sig.args[0].dtype, out_a.data, args[1], vb, args[7])
            return context.get_dummy_value()

        return types.none(out, o, words, w, lo, step, zero_exact, streaming), codegen

    return store16


def _make_grid_store16(bits: int):  # type: ignore[no-untyped-def]
    """``_make_store16`` for a plain group on a fitted grid: 16 codes decoded as ``lo + g[c] * step``, the
    level picked by selects (``NOTE [ Grid kernels without gathers ]``)."""

    @intrinsic
    def grid_store16(typingctx, out, o, words, w, lo, step, grid_values, streaming):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            out_a = context.make_array(sig.args[0])(context, builder, args[0])
            words_a = context.make_array(sig.args[2])(context, builder, args[2])
            g_a = context.make_array(sig.args[6])(context, builder, args[6])
            c = _codes16(builder, words_a.data, args[3], bits, 0)
            level = _splat(builder, builder.load(builder.gep(g_a.data, [ir.Constant(_I32, 0)])), _V16F)
            for j in range(1, 1 << bits):
                g_j = _splat(builder, builder.load(builder.gep(g_a.data, [ir.Constant(_I32, j)])), _V16F)
                level = builder.select(builder.icmp_unsigned("==", c, _i32x16(j)), g_j, level)
            v = builder.fadd(_splat(builder, args[4], _V16F), builder.fmul(level, _splat(builder, args[5], _V16F)))
            _store16(builder, sig.args[0].dtype, out_a.data, args[1], builder.bitcast(v, _V16I), args[7])
            return context.get_dummy_value()

        return types.none(out, o, words, w, lo, step, grid_values, streaming), codegen

    return grid_store16


_STORE16_1, _STORE16_1H = _make_store16(1), _make_store16(1, 16)  # a word's lower and upper half
_STORE16_2, _STORE16_4, _STORE16_8 = _make_store16(2), _make_store16(4), _make_store16(8)
_GRID_STORE16_2, _GRID_STORE16_4 = _make_grid_store16(2), _make_grid_store16(4)


# NOTE [ Inlined group decode ]
# ``_decode_group`` and ``_decode_vec32`` are inlined into ``_dequantize``'s parallel loop
# (``inline="always"``: numba splices their IR in; LLVM did not inline the calls). As calls, each group
# paid a call overhead (five arrays passed as exploded structs) that made small groups (64 values)
# decode several times slower than large ones; inlined, they run close to the output's write limit
# (docs/kernels.md), at no cost in compile time.
@njit(inline="always", **_JIT)
def _decode_vec32(c32, w0, n32, bits, zero_exact, lo, step, out, o0, streaming):  # type: ignore[no-untyped-def]
    """Decode ``n32`` runs of 32 codes (``32 * bits / 32 = bits`` words each) from word ``w0`` of ``c32``
    into float32 ``out`` from ``o0``: two explicit 16-lane vectors per run."""
    if bits == 1:
        for j in range(n32):
            _STORE16_1(out, _U(o0 + 32 * j), c32, _U(w0 + j), lo, step, zero_exact, streaming)
            _STORE16_1H(out, _U(o0 + 32 * j + 16), c32, _U(w0 + j), lo, step, zero_exact, streaming)
    elif bits == 2:
        for j in range(2 * n32):
            _STORE16_2(out, _U(o0 + 16 * j), c32, _U(w0 + j), lo, step, zero_exact, streaming)
    elif bits == 4:
        for j in range(2 * n32):
            _STORE16_4(out, _U(o0 + 16 * j), c32, _U(w0 + 2 * j), lo, step, zero_exact, streaming)
    else:
        for j in range(2 * n32):
            _STORE16_8(out, _U(o0 + 16 * j), c32, _U(w0 + 4 * j), lo, step, zero_exact, streaming)


@njit(inline="always", **_JIT)
def _decode_group(codes, c32, c0, bits, count, lo_b, sb, out, o0, streaming):  # type: ignore[no-untyped-def]
    """Decode ``count`` values of one group (codes from byte ``c0``; ``c32``: the 32-bit word view of
    ``codes``) into ``out[o0:o0 + count]``; ``streaming``: see ``NOTE [ Streaming stores ]``."""
    lo = bits_f32(lo_b)
    step, zero_exact = _scale_step(sb)
    per = 8 // bits
    mask = (1 << bits) - 1
    full = 0
    if np.isfinite(lo) and np.isfinite(step):
        full = count // 32
        _decode_vec32(c32, c0 // 4, full, bits, zero_exact, lo, step, out, o0, streaming)
        full *= 32
    for j in range(full, count):
        c = (codes[_U(c0 + j // per)] >> ((j % per) * bits)) & mask
        _store_bits(out, _U(o0 + j), _decode_special(c, lo, step, zero_exact))


@njit(**_PJIT)
def _dequantize(codes, lo_b, scale_b, bits, group_size, n, out, nchunks, streaming):  # type: ignore[no-untyped-def]
    """Decode all groups, parallel over runs of groups (or over tiles of a few huge groups);
    ``streaming``: see ``NOTE [ Streaming stores ]``."""
    ng = lo_b.shape[0]
    nbytes = group_size * bits // 8
    # Split groups into tiles of whole bytes when there are fewer groups than tasks.
    tpg = max(1, min(nchunks // max(ng, 1), group_size // 4096))
    tile = (group_size // tpg + 31) // 32 * 32
    tpg = (group_size + tile - 1) // tile
    nt = ng * tpg
    per = (nt + nchunks - 1) // nchunks
    for ci in prange(nchunks):
        _, c32, _ = _word_views(codes)
        for t in range(ci * per, min(nt, (ci + 1) * per)):
            g = t // tpg
            off = (t % tpg) * tile
            a = g * group_size + off
            count = min(min(n, (g + 1) * group_size), a + tile) - a
            if count > 0:
                c0 = g * nbytes + off * bits // 8
                _decode_group(codes, c32, c0, bits, count, lo_b[g], scale_b[g], out, a, streaming)
        if streaming:
            _store_fence()


@njit(**_PJIT)
def _dequantize_grid(codes, lo_b, scale_b, bits, group_size, n, grid, out, nchunks, streaming):  # type: ignore[no-untyped-def]
    """``_dequantize`` of a record on the fitted ``grid``: plain groups with finite lo and step decode
    ``lo + g[c] * step``, the others as without a grid; parallel over runs of groups."""
    ng = lo_b.shape[0]
    nbytes = group_size * bits // 8
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    per = (ng + nchunks - 1) // nchunks
    for ci in prange(nchunks):
        _, c32, _ = _word_views(codes)
        for g in range(ci * per, min(ng, (ci + 1) * per)):
            a = g * group_size
            count = min(n, a + group_size) - a
            c0 = g * nbytes
            lo = bits_f32(lo_b[g])
            step, zero_exact = _scale_step(scale_b[g])
            if zero_exact or not (np.isfinite(lo) and np.isfinite(step)):
                _decode_group(codes, c32, c0, bits, count, lo_b[g], scale_b[g], out, a, streaming)
                continue
            full = count // 16 * 16
            w0 = c0 // 4
            for j in range(count // 16):
                if bits == 2:
                    _GRID_STORE16_2(out, _U(a + 16 * j), c32, _U(w0 + j), lo, step, grid, streaming)
                else:
                    _GRID_STORE16_4(out, _U(a + 16 * j), c32, _U(w0 + 2 * j), lo, step, grid, streaming)
            for j in range(full, count):
                c = (codes[_U(c0 + j // per_byte)] >> ((j % per_byte) * bits)) & mask
                _store_bits(out, _U(a + j), f32_bits(lo + grid[c] * step))
        if streaming:
            _store_fence()


@njit(**_PJIT)
def _pack_bool(x, out, nchunks):  # type: ignore[no-untyped-def]
    n = x.shape[0]
    nb = out.shape[0]
    per = (nb + nchunks - 1) // nchunks
    for ci in prange(nchunks):
        k0 = ci * per
        k1 = min(nb, k0 + per)
        kfull = min(k1, n // 8)
        for k in range(k0, kfull):
            j = 8 * k
            out[k] = np.uint8(
                (x[j] != 0)
                | ((x[j + 1] != 0) << 1)
                | ((x[j + 2] != 0) << 2)
                | ((x[j + 3] != 0) << 3)
                | ((x[j + 4] != 0) << 4)
                | ((x[j + 5] != 0) << 5)
                | ((x[j + 6] != 0) << 6)
                | ((x[j + 7] != 0) << 7)
            )
        for k in range(max(k0, kfull), k1):
            acc = 0
            for s in range(8):
                j = 8 * k + s
                if j < n and x[j] != 0:
                    acc |= 1 << s
            out[k] = np.uint8(acc)


@njit(**_PJIT)
def _unpack_bool(packed, out, nchunks):  # type: ignore[no-untyped-def]
    n = out.shape[0]
    nb = packed.shape[0]
    per = (nb + nchunks - 1) // nchunks
    for ci in prange(nchunks):
        k0 = ci * per
        k1 = min(nb, k0 + per)
        kfull = min(k1, n // 8)
        for k in range(k0, kfull):
            byte = packed[k]
            for s in range(8):
                out[8 * k + s] = (byte >> s) & 1
        for k in range(max(k0, kfull), k1):
            byte = packed[k]
            for s in range(8):
                j = 8 * k + s
                if j < n:
                    out[j] = (byte >> s) & 1


# ---------------------------------------------------------------------------------------------
# Python wrappers (the registered kernels)
# ---------------------------------------------------------------------------------------------

# The workqueue threading layer aborts the process when two Python threads run parallel kernels
# at once; the tbb and omp layers are thread-safe. Calls are serialised only under workqueue.
_WORKQUEUE_LOCK = threading.Lock()
_layer_checked: list[bool] = []


def threads() -> int:
    """Threads the kernels use: PyTorch's intra-op thread count, capped by numba's pool."""
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


# NOTE [ Threads per call ]
# A parallel region costs a wake-up of every pool thread, and its static schedule waits for the
# slowest one, which on a busy machine may be waiting for a core. Below a few MB a second thread
# saves less than that costs, so a call gets one thread per ``_VALUES_PER_THREAD`` values. The bytes
# do not depend on the thread count (see the module docstring), only the speed does.
_VALUES_PER_THREAD = 1 << 19


def _sync_threads(values: int | None = None) -> int:
    n = threads()
    if values is not None:
        n = max(1, min(n, values // _VALUES_PER_THREAD))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


def _chunks(units: int, nthreads: int) -> int:
    return max(1, min(units, 4 * nthreads))


# NOTE [ numba's thread pool and PyTorch's OpenMP runtime ]
# numba's default ``omp`` layer runs its parallel regions on the libgomp PyTorch already loaded,
# whose idle threads spin before they sleep.
#   * idle machine: ``omp`` is clearly faster than numba's own ``workqueue`` pool -- so daftrain keeps
#     numba's default;
#   * machine with more busy threads than cores (other jobs, data-loader workers): a thread spinning
#     at a barrier holds a core the thread it waits for needs, and every ``omp`` call stalls for a
#     scheduler time slice, whatever its size. ``OMP_WAIT_POLICY=PASSIVE`` set before
#     ``import torch``, or ``NUMBA_THREADING_LAYER=workqueue``, avoid it; a library cannot set the
#     first in time. One thread per ``_VALUES_PER_THREAD`` values keeps the many small calls (below)
#     out of parallel regions either way. The measurements are in docs/kernels.md.
# ``workqueue`` is not safe for parallel calls from two Python threads at once: if it runs, calls are
# serialised (``_WORKQUEUE_LOCK``).
_POOL_LOCK = threading.Lock()
_pool_started: list[bool] = []


def _start_thread_pool() -> None:
    with _POOL_LOCK:
        if _pool_started:
            return
        from numba.np.ufunc import parallel

        parallel._launch_threads()
        if not _layer_checked:
            _layer_checked.append(numba.threading_layer() == "workqueue")
        _pool_started.append(True)


class _Guard:
    """Context manager around a parallel numba call: thread count, workqueue serialisation, and
    PyTorch's thread count kept as it was -- starting numba's OpenMP pool (first parallel call) calls
    ``omp_set_num_threads`` in the process's libgomp, which resets ``torch.get_num_threads()``."""

    def __init__(self, values: int | None = None) -> None:
        self._values = values  # work of the call, in values: sets the thread count (NOTE above)

    def __enter__(self) -> int:
        self._torch_threads = torch.get_num_threads()
        if not _pool_started:
            _start_thread_pool()  # may reset PyTorch's thread count: set it back before reading it
            torch.set_num_threads(self._torch_threads)
        self._locked = False
        if _layer_checked and _layer_checked[0]:
            _WORKQUEUE_LOCK.acquire()
            self._locked = True
        return _sync_threads(self._values)

    def __exit__(self, *exc: object) -> None:
        if self._locked:
            _WORKQUEUE_LOCK.release()
        if torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        if not _layer_checked:
            try:
                _layer_checked.append(numba.threading_layer() == "workqueue")
            except ValueError:  # no parallel region has run yet
                pass


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_madvise = _load_madvise()


# ---------------------------------------------------------------------------------------------
# Groups down the columns
# ---------------------------------------------------------------------------------------------


# NOTE [ Column kernels ]
# ``quantize_pack_columns`` stores a ``[rows, cols]`` tensor in groups that each hold one column of a
# block of ``group_size`` rows (``reference.columns_first``): the bytes of ``quantize_pack`` of that order,
# without making it. A task is one block of rows, read row after row: first the block's per-column min,
# max and min positive, accumulated in ``cols``-long arrays (one value of each column per row, so the
# loop over columns is contiguous and vectorises), then byte ``k`` of every column's codes from rows
# ``k * 8 / bits`` onwards, again a loop over columns with each column's ``lo``, ``1 / step`` and mode in
# arrays. A value's noise index is its position in the stored order, as the reference's. Every lane does
# the reference's arithmetic, operation for operation, with each group's mode as a select: zero-exact
# groups (``top = L - 1``, code 0 for exact zeros), groups on the fitted grid (the level below and its
# width picked by compares and selects over a tuple of the grid's levels, ``NOTE [ Grid kernels without
# gathers ]``) and non-finite groups (NaN codes clamp to 0, as the scalar path's). The decode is the same
# walk backwards: byte ``k`` of every column's codes, gathered into a contiguous array, gives rows
# ``k * 8 / bits`` onwards; groups with a non-finite ``lo`` or step are then decoded again value by value
# with ``_decode_special``. Helpers taking the row or byte loop are inlined, and the loops keep their
# stores unconditional (a value computed and selected, then stored): a conditional store or a call in
# the loop kept LLVM from vectorising it. The block of ``group_size`` rows is read twice (stats, then
# codes), the second time from cache; docs/kernels.md has the timings.
@njit(inline="always", **_JIT)
def _column_stats(xb, base, cols, group_size, kmin, kmax, pmin):  # type: ignore[no-untyped-def]
    """Per column of rows ``base / cols ..`` (``group_size`` of them): min key, max key, min positive bits."""
    for c in range(cols):
        kmin[_U(c)] = np.int32(0x7FFFFFFF)
        kmax[_U(c)] = np.int32(-0x80000000)
        pmin[_U(c)] = np.int32(_INF)
    for r in range(group_size):
        row = base + r * cols
        for c in range(cols):
            v = _load_bits(xb[_U(row + c)])
            k = v ^ ((v >> 31) & 0x7FFFFFFF)
            kmin[_U(c)] = min(k, kmin[_U(c)])
            kmax[_U(c)] = max(k, kmax[_U(c)])
            p = v if np.uint32(v - 1) < np.uint32(_INF) else np.int32(_INF)
            pmin[_U(c)] = min(p, pmin[_U(c)])


def _make_column_bytes(bits: int, inner: int):  # type: ignore[no-untyped-def]
    """Byte ``k`` of the codes of every column of a block at ``bits`` bits; with ``inner`` (2 or 14: the
    grid's inner levels), groups flagged ``on_grid`` round onto the fitted grid (``NOTE [ Column kernels ]``)."""
    per_byte = 8 // bits

    @njit(inline="always", **_JIT)
    def levels_of(grid, widths):  # type: ignore[no-untyped-def]
        if inner == 2:
            return (grid[0], grid[1], grid[2], grid[3]), (widths[0], widths[1], widths[2], widths[3])
        return ((grid[0], grid[1], grid[2], grid[3], grid[4], grid[5], grid[6], grid[7], grid[8], grid[9],
                 grid[10], grid[11], grid[12], grid[13], grid[14], grid[15]),
                (widths[0], widths[1], widths[2], widths[3], widths[4], widths[5], widths[6], widths[7], widths[8],
                 widths[9], widths[10], widths[11], widths[12], widths[13], widths[14], widths[15]))

    @njit(inline="always", **_JIT)
    def column_bytes(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths,  # type: ignore[no-untyped-def]
                     out):
        if inner:
            gv, wv = levels_of(grid, widths)
        for c in range(cols):
            lo_c = lo[_U(c)]
            inv_c = inv[_U(c)]
            top_c = top[_U(c)]
            z = zero_exact[_U(c)]
            grid_c = on_grid[_U(c)]
            byte = np.int32(0)
            for s in range(per_byte):
                x = bits_f32(_load_bits(xb[_U(row + s * cols + c)]))
                t = (x - lo_c) * inv_c
                if inner:  # the grid's levels as a tuple: the selects unroll over registers
                    on = _grid_position(t, gv, wv, inner)
                    t = on if grid_c else t
                r = np.floor(t + _noise(i0 + c * group_size + s, seed))
                code = top_c if top_c < r else r  # clamp; NaN stays NaN here ...
                code = code if code > 0 else np.float32(0.0)  # ... and becomes 0 here
                special = (z != 0) & ((x == 0) | (r != r))
                byte |= (np.int32(0) if special else np.int32(code) + z) << (bits * s)
            out[_U(c)] = np.uint8(byte)

    return column_bytes


_COLUMN_BYTES_1, _COLUMN_BYTES_2, _COLUMN_BYTES_4, _COLUMN_BYTES_8 = (_make_column_bytes(b, 0) for b in (1, 2, 4, 8))
_COLUMN_BYTES_2G, _COLUMN_BYTES_4G = _make_column_bytes(2, 2), _make_column_bytes(4, 14)


@njit(**_JIT)
def _quantize_column_block(  # type: ignore[no-untyped-def]
    xb, cols, group_size, bits, seed, grid, widths, codes, lo_out, scale_out, block
):
    """Stats, params and codes of the ``cols`` groups of rows ``block * group_size ..``."""
    nbytes = group_size * bits // 8
    per_byte = 8 // bits
    levels = np.float32((1 << bits) - 1)
    has_grid = grid.shape[0] > 0
    kmin = np.empty(cols, np.int32)
    kmax = np.empty(cols, np.int32)
    pmin = np.empty(cols, np.int32)
    base = block * group_size * cols
    _column_stats(xb, base, cols, group_size, kmin, kmax, pmin)
    lo = np.empty(cols, np.float32)
    inv = np.empty(cols, np.float32)
    top = np.empty(cols, np.float32)
    zero_exact = np.empty(cols, np.int32)
    on_grid = np.empty(cols, np.bool_)
    g0 = block * cols
    for c in range(cols):
        mn, mx, mp = _keys_to_stats(np.int32(kmin[c]), np.int32(kmax[c]), np.int32(pmin[c]))
        lo_b, sb = _params(mn, mx, mp, bits)
        lo_out[g0 + c] = lo_b
        scale_out[g0 + c] = sb
        lo[c] = bits_f32(lo_b)
        step, z = _scale_step(sb)
        inv[c] = np.float32(1.0) / step if step > 0 else np.float32(0.0)
        zero_exact[c] = 1 if z else 0
        top[c] = levels - np.float32(1.0) if z else levels
        on_grid[c] = has_grid and not z and np.isfinite(lo[c]) and np.isfinite(step)
    out = np.empty(cols, np.uint8)
    for k in range(nbytes):
        row = base + k * per_byte * cols
        i0 = g0 * group_size + k * per_byte
        if has_grid and bits == 2:
            _COLUMN_BYTES_2G(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths, out)
        elif has_grid:
            _COLUMN_BYTES_4G(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths, out)
        elif bits == 1:
            _COLUMN_BYTES_1(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths, out)
        elif bits == 2:
            _COLUMN_BYTES_2(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths, out)
        elif bits == 4:
            _COLUMN_BYTES_4(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths, out)
        else:
            _COLUMN_BYTES_8(xb, row, cols, i0, group_size, seed, lo, inv, top, zero_exact, on_grid, grid, widths, out)
        o0 = g0 * nbytes + k
        for c in range(cols):
            codes[_U(o0 + c * nbytes)] = out[_U(c)]


@njit(**_PJIT)
def _quantize_columns(  # type: ignore[no-untyped-def]
    xb, rows, cols, group_size, bits, seed, grid, codes, lo_out, scale_out
):
    """``quantize_pack_columns``: one task per block of ``group_size`` rows (``NOTE [ Column kernels ]``)."""
    widths = _grid_widths(grid)
    for block in prange(rows // group_size):
        _quantize_column_block(xb, cols, group_size, bits, seed, grid, widths, codes, lo_out, scale_out, block)


def _make_column_decode(bits: int, from_table: bool):  # type: ignore[no-untyped-def]
    """Rows ``k * 8 / bits ..`` of a block from byte ``k`` of every column's codes (``NOTE [ Column kernels ]``);
    ``from_table``: each value's bits looked up in ``table`` (``2**bits`` per column)."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1

    @njit(inline="always", **_JIT)
    def column_decode(byte_of, cols, lo, step, zero_exact, table, out, row):  # type: ignore[no-untyped-def]
        for s in range(per_byte):
            for c in range(cols):
                code = np.int32((np.int32(byte_of[_U(c)]) >> (bits * s)) & mask)
                if from_table:
                    b = table[_U(c * (mask + 1) + code)]
                else:
                    z = zero_exact[_U(c)]
                    b = f32_bits(lo[_U(c)] + np.float32(np.int32(code - z)) * step[_U(c)])
                    b = np.int32(0) if (z != 0) & (code == 0) else b
                if _is_f32(out):
                    out[_U(row + s * cols + c)] = b
                else:
                    _store_bits(out, _U(row + s * cols + c), b)

    return column_decode


_COLUMN_DECODE_1, _COLUMN_DECODE_2, _COLUMN_DECODE_4, _COLUMN_DECODE_8 = (
    _make_column_decode(b, False) for b in (1, 2, 4, 8))
_COLUMN_DECODE_2G, _COLUMN_DECODE_4G = _make_column_decode(2, True), _make_column_decode(4, True)


@njit(**_JIT)
def _decode_column_block(codes, lo_b, scale_b, cols, group_size, bits, grid, out, block):  # type: ignore[no-untyped-def]
    """Decode the ``cols`` groups of rows ``block * group_size ..`` into their places in ``out``."""
    nbytes = group_size * bits // 8
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    has_grid = grid.shape[0] > 0
    g0 = block * cols
    lo = np.empty(cols, np.float32)
    step = np.empty(cols, np.float32)
    zero_exact = np.empty(cols, np.int32)
    on_grid = np.empty(cols, np.bool_)
    finite = True
    for c in range(cols):
        lo[c] = bits_f32(lo_b[g0 + c])
        st, z = _scale_step(scale_b[g0 + c])
        step[c] = st
        zero_exact[c] = 1 if z else 0
        ok = np.isfinite(lo[c]) and np.isfinite(st)
        on_grid[c] = has_grid and ok and not z
        finite = finite and ok
    base = block * group_size * cols
    levels = 1 << bits
    table = np.empty(cols * levels if has_grid else 0, np.int32)
    if has_grid:  # each column's value of each code (the decode rules of ``_decode_group`` and the grid's)
        for c in range(cols):
            z = zero_exact[c]
            for code in range(levels):
                k = grid[code] if on_grid[c] else np.float32(code - z)
                b = f32_bits(lo[c] + k * step[c])
                table[c * levels + code] = np.int32(0) if (z != 0) and code == 0 else b
    byte_of = np.empty(cols, np.uint8)
    for k in range(nbytes):
        o0 = g0 * nbytes + k
        for c in range(cols):
            byte_of[_U(c)] = codes[_U(o0 + c * nbytes)]
        row = base + k * per_byte * cols
        if has_grid and bits == 2:
            _COLUMN_DECODE_2G(byte_of, cols, lo, step, zero_exact, table, out, row)
        elif has_grid:
            _COLUMN_DECODE_4G(byte_of, cols, lo, step, zero_exact, table, out, row)
        elif bits == 1:
            _COLUMN_DECODE_1(byte_of, cols, lo, step, zero_exact, table, out, row)
        elif bits == 2:
            _COLUMN_DECODE_2(byte_of, cols, lo, step, zero_exact, table, out, row)
        elif bits == 4:
            _COLUMN_DECODE_4(byte_of, cols, lo, step, zero_exact, table, out, row)
        else:
            _COLUMN_DECODE_8(byte_of, cols, lo, step, zero_exact, table, out, row)
    if not finite:  # groups with a non-finite lo or step: the reference's NaN rules, value by value
        for c in range(cols):
            if np.isfinite(lo[c]) and np.isfinite(step[c]):
                continue
            o0 = (g0 + c) * nbytes
            for r in range(group_size):
                code = np.int32((codes[_U(o0 + r // per_byte)] >> ((r % per_byte) * bits)) & mask)
                _store_bits(out, _U(base + r * cols + c), _decode_special(code, lo[c], step[c], zero_exact[c] != 0))


@njit(**_PJIT)
def _dequantize_columns(codes, lo_b, scale_b, rows, cols, group_size, bits, grid, out):  # type: ignore[no-untyped-def]
    """``unpack_dequantize_columns_into``: one task per block of ``group_size`` rows."""
    for block in prange(rows // group_size):
        _decode_column_block(codes, lo_b, scale_b, cols, group_size, bits, grid, out, block)


def _empty(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` whose pages (when large) are hinted as transparent huge pages before first touch.

    A fresh multi-MB output is a fresh mmap: with 4 KiB pages, faulting it in can cost more than the
    kernel that fills it. ``MADV_HUGEPAGE`` (what PyTorch does under
    ``THP_MEM_ALLOC_ENABLE=1``) cuts that to a fraction; it is only a hint, failures are ignored.
    """
    out = torch.empty(shape, dtype=dtype, device="cpu")
    nbytes = out.numel() * out.element_size()
    if _madvise is not None and nbytes >= 2 * _HUGE_PAGE:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        stop = (out.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if stop > start:
            _madvise(start, stop - start, _MADV_HUGEPAGE)
    return out


# NOTE [ What the kernels trust ]
# The kernels do no bounds checks: they trust what the op's check (``ops.py``) verified once, at the
# op boundary, before any kernel runs -- dtypes, bits, group size, and that codes / lo / scale / out
# have the sizes the layout implies. They re-validate nothing. What they still do for memory safety is
# what the op checks do not cover: they take contiguous copies of inputs whose strides the checks
# allow (``_flat``, ``.contiguous()`` on codes, lo and scale), and a float32 decode stores
# non-temporally only into a 64-byte aligned output (``streams``). ``quantize_pack_with``, the one
# public entry that bypasses the op, runs the op's check itself. The same holds for ``triton.py``.
_BITS_AS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _raw(x: torch.Tensor) -> np.ndarray:
    """Flat contiguous float tensor -> numpy view of its raw bits (int32 / int16 bf16 / uint16 f16), the
    element type the kernels dispatch on (``_load_bits``, ``_store_bits``)."""
    raw = x.view(_BITS_AS[x.dtype]).numpy()
    return raw.view(np.uint16) if x.dtype == torch.float16 else raw


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous()


def _tile(group_size: int, num_groups: int, nthreads: int) -> int:
    """Tile length (a multiple of 32 dividing the work into about 4 tiles per thread)."""
    want = max(1, -(-4 * nthreads // max(num_groups, 1)))
    tile = -(-group_size // want)
    tile = max(1024, -(-tile // 32) * 32)
    return min(group_size, tile)


def minmax_per_group(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``group_minmax`` with the ``per_group`` strategy."""
    x = _flat(x)
    n = x.numel()
    ng = -(-n // group_size)
    out = torch.empty(ng, 3, dtype=torch.float32, device="cpu")
    if ng:
        with _Guard(n) as nt:
            _minmax_per_group(_raw(x), n, group_size, out.view(torch.int32).numpy(), _chunks(ng, nt))
    return out


def minmax_two_level(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``group_minmax`` with the ``two_level`` strategy."""
    x = _flat(x)
    n = x.numel()
    ng = -(-n // group_size)
    out = torch.empty(ng, 3, dtype=torch.float32, device="cpu")
    if ng:
        with _Guard(n) as nt:
            tile = _tile(group_size, ng, nt)
            _minmax_two_level(_raw(x), n, group_size, tile, out.view(torch.int32).numpy())
    return out


STRATEGIES = {PER_GROUP: minmax_per_group, TWO_LEVEL: minmax_two_level}
_NO_GRID = np.empty(0, np.float32)


def _fitted(grid: torch.Tensor | None) -> np.ndarray | None:
    """``grid``'s levels, or ``None`` for no grid or the uniform one: the same bytes either way (``layout.py``),
    and the kernels without a grid are faster (a compiled graph passes the uniform grid where its fit found no
    gain: ``NOTE [ Fitted grids in compiled graphs ]`` in saved/compiled.py)."""
    if grid is None:
        return None
    levels = grid.numpy()
    return None if bool((levels == np.arange(levels.shape[0], dtype=np.float32)).all()) else levels


def make_kernels(selector: ReductionSelector) -> dict[str, Callable[..., Any]]:
    """The op kernels by op name, ``group_minmax`` / ``quantize_pack`` scheduled by ``selector``;
    they trust their arguments (``NOTE [ What the kernels trust ]``)."""

    def group_minmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
        flat = _flat(x)
        strategy = selector.choose(flat.numel(), group_size, flat.dtype)
        return STRATEGIES[strategy](flat, group_size)

    def quantize_pack(
        x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = _flat(x)
        n = flat.numel()
        ng = -(-n // group_size)
        nbytes = group_size * bits // 8
        codes = _empty((ng, nbytes), torch.uint8)
        lo = torch.empty(ng, dtype=torch.float32, device="cpu")
        scale = torch.empty(ng, dtype=torch.bfloat16, device="cpu")
        if ng == 0:
            return codes, lo, scale
        seed32 = np.uint32(seed & 0xFFFFFFFF)
        xb = _raw(flat)
        lo_np = lo.view(torch.int32).numpy()
        sc_np = scale.view(torch.int16).numpy()
        codes_np = codes.view(-1).numpy()
        # The tiled schedule reads the input twice (stats, then codes); it only pays where the fused
        # one cannot keep the threads busy: few groups per thread. There the selector decides.
        strategy = PER_GROUP if ng >= 8 * threads() else selector.choose(n, group_size, flat.dtype)
        levels = _fitted(grid)
        if levels is not None:  # one schedule: a grid's record reads its groups once, whatever their number
            with _Guard(n) as nt:
                _quantize_per_group(xb, n, group_size, bits, seed32, levels, codes_np, lo_np, sc_np, _chunks(ng, nt))
        elif strategy == TWO_LEVEL:
            stats = minmax_two_level(flat, group_size)
            with _Guard(n) as nt:
                _params_all(stats.view(torch.int32).numpy(), bits, lo_np, sc_np)
                tile = _tile(group_size, ng, nt)
                _quantize_tiles(xb, n, group_size, bits, seed32, tile, lo_np, sc_np, codes_np)
        else:
            with _Guard(n) as nt:
                _quantize_per_group(xb, n, group_size, bits, seed32, _NO_GRID, codes_np, lo_np, sc_np, _chunks(ng, nt))
        return codes, lo, scale

    return {fn.__name__: fn for fn in (group_minmax, quantize_pack, reference.seeded(quantize_pack), unpack_dequantize,
                                       unpack_dequantize_into, quantize_pack_columns, unpack_dequantize_columns_into,
                                       pack_bool, unpack_bool)}


def _payload(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, lo, scale)`` as the flat numpy arrays of raw bits the decode kernels take."""
    return (codes.detach().contiguous().view(-1).numpy(), lo.detach().contiguous().view(torch.int32).numpy(),
            scale.detach().contiguous().view(torch.int16).numpy())


def unpack_dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
    grid: torch.Tensor | None = None,
) -> None:
    """Decode into a preallocated contiguous 1-D ``out`` (its dtype and numel say what to decode)."""
    numel = out.numel()
    if numel == 0:
        return
    codes_np, lo_np, sc_np = _payload(codes, lo, scale)
    out_np = _raw(out)
    levels = _fitted(grid)
    with _Guard(numel) as nt:
        if levels is not None:
            _dequantize_grid(codes_np, lo_np, sc_np, bits, group_size, numel, levels, out_np, 4 * nt, streams(out))
        else:
            _dequantize(codes_np, lo_np, sc_np, bits, group_size, numel, out_np, 4 * nt, streams(out))


unpack_dequantize = reference.allocating(unpack_dequantize_into, lambda numel, dtype, device: _empty(numel, dtype))


def quantize_pack_columns(
    x: torch.Tensor, cols: int, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_pack`` of ``x`` in groups down its columns (``NOTE [ Column kernels ]``)."""
    flat = _flat(x)
    n = flat.numel()
    ng = n // group_size
    codes = _empty((ng, group_size * bits // 8), torch.uint8)
    lo = torch.empty(ng, dtype=torch.float32, device="cpu")
    scale = torch.empty(ng, dtype=torch.bfloat16, device="cpu")
    if ng == 0:
        return codes, lo, scale
    with _Guard(n):
        _quantize_columns(_raw(flat), n // cols, cols, group_size, bits, np.uint32(seed & 0xFFFFFFFF),
                          _NO_GRID if grid is None else grid.numpy(), codes.view(-1).numpy(),
                          lo.view(torch.int32).numpy(), scale.view(torch.int16).numpy())
    return codes, lo, scale


def unpack_dequantize_columns_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, cols: int, bits: int,
    group_size: int, grid: torch.Tensor | None = None,
) -> None:
    """Decode what ``quantize_pack_columns`` wrote into the contiguous 1-D ``out`` (rows first)."""
    numel = out.numel()
    if numel == 0:
        return
    codes_np, lo_np, sc_np = _payload(codes, lo, scale)
    with _Guard(numel):
        _dequantize_columns(codes_np, lo_np, sc_np, numel // cols, cols, group_size, bits,
                            _NO_GRID if grid is None else grid.numpy(), _raw(out))


def pack_bool(x: torch.Tensor) -> torch.Tensor:
    flat = _flat(x)
    n = flat.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device="cpu")
    if n:
        with _Guard(n // 4) as nt:
            _pack_bool(flat.view(torch.uint8).numpy(), out.numpy(), _chunks(out.numel() // 4096 + 1, nt))
    return out


def unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = _empty(numel, torch.bool)
    if numel:
        p = packed.detach().contiguous().view(-1)
        with _Guard(numel // 4) as nt:
            _unpack_bool(p.numpy(), out.view(torch.uint8).numpy(), _chunks(p.numel() // 4096 + 1, nt))
    return out


def quantize_pack_with(
    strategy: str, x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_pack`` with a forced schedule (``per_group`` / ``two_level``), for tests and benchmarks;
    it bypasses the op, so it runs the op's check itself."""
    ops.quantize_pack.check(x, bits, group_size, seed, grid)
    forced = ReductionSelector("cpu", STRATEGIES, forced=strategy)
    return make_kernels(forced)["quantize_pack"](x, bits, group_size, seed, grid)


# NOTE [ Tensors daftrain creates name their device and dtype ]
# ``torch.set_default_device("cuda")`` (or ``with torch.device(...)``) makes every factory call without a device
# create its tensor there, through a torch function mode active in the user's frames: when a context is constructed
# (this warm-up), in its ``__exit__`` (the small saves sealed there), in the op rules' handler. Host buffers then
# landed on the default device: the pinned buffer of the checks read later raised "Only dense CPU tensors can be
# pinned", and this warm-up failed, leaving the reference kernels for the whole process. ``torch.set_default_dtype(
# torch.float64)`` (common in scientific models) failed this warm-up the same way: float64 values, which the kernels
# do not take. So every factory call in daftrain names its device ("cpu" for host work, the input's otherwise) and
# its dtype (``tests/test_factory_calls.py`` reads the source for calls without them).
# NOTE [ Kernels load before the first step ]
# A process's first call of each kernel specialisation loads it from numba's on-disk cache (or
# compiles it, on a machine's first run), and the very first one also builds numba's typing and
# target contexts and imports its parallel back end: most of a second of CPU in all, which would land
# in the first training step. ``compress`` on CPU calls ``load_fast_kernels(warmup=True)`` when it is
# constructed, so ``warmup`` runs there, once per process: it loads the float32 specialisations every
# float32 model calls and starts numba's thread pool. Other dtypes load at their first call, in
# milliseconds each once numba is up. The measurements are in docs/memory.md.
@functools.cache
def warmup() -> None:
    """Compile (or load from numba's cache) the float32 specialisations of every kernel; once per process
    (``NOTE [ Kernels load before the first step ]``)."""
    x = torch.linspace(-1, 1, 100, dtype=torch.float32, device="cpu")
    for strategy in STRATEGIES:
        c, lo, s = quantize_pack_with(strategy, x, 2, 32, 0)
        STRATEGIES[strategy](x, 32)
    unpack_dequantize(c, lo, s, 2, 32, 100, torch.float32)
    grid = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float32, device="cpu")
    c, lo, s = quantize_pack_with(PER_GROUP, x, 2, 32, 0, grid)
    unpack_dequantize(c, lo, s, 2, 32, 100, torch.float32, grid)
    rows = torch.linspace(-1, 1, 64, dtype=torch.float32, device="cpu")
    for g in (None, grid):
        c, lo, s = quantize_pack_columns(rows, 2, 2, 32, 0, g)
        unpack_dequantize_columns_into(torch.empty(64, dtype=torch.float32, device="cpu"), c, lo, s, 2, 2, 32, g)
    unpack_bool(pack_bool(x > 0), 100)
