"""Pure PyTorch reference kernels: the executable spec of the unified layout (see ``layout.py``).

They run on every device. They are vectorised and work on chunks of whole groups so that their
temporaries stay bounded (``_CHUNK_VALUES`` values at a time) however large the tensor is. Fast
kernels (``kernels/cpu.py``, ``kernels/triton.py``) must produce byte-identical output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..layout import MASK32, PackedLayout

_CHUNK_VALUES = 1 << 20
_INF = float("inf")
_MIN_NORMAL = torch.finfo(torch.float32).tiny  # 2**-126


def _chunks(num_groups: int, group_size: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_VALUES // group_size)
    for g0 in range(0, num_groups, step):
        yield g0, min(num_groups, g0 + step)


def _group_block(x: torch.Tensor, g0: int, g1: int, group_size: int, fill: float) -> torch.Tensor:
    """Groups ``g0:g1`` of flat ``x`` as float32 [g1 - g0, G], the ragged tail padded with ``fill``."""
    start, stop = g0 * group_size, min(g1 * group_size, x.numel())
    block = x[start:stop].to(torch.float32)
    pad = (g1 - g0) * group_size - (stop - start)
    if pad:
        block = torch.cat([block, block.new_full((pad,), fill)])
    return block.view(g1 - g0, group_size)


def group_minmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group ``[min, max, min over positive values (+inf if none)]`` as float32 [num_groups, 3].

    NaN propagates into min and max, so a caller can tell a non-finite group from its stats alone.
    Zeros follow IEEE 754's total order (-0.0 < +0.0): a group holding both has min -0.0 and max
    +0.0. PyTorch's ``amin``/``amax`` leave that tie to the lane layout of their vectorised loop, so
    it is settled explicitly here and every backend returns the same bytes.
    """
    x = x.reshape(-1)
    num_groups = -(-x.numel() // group_size)
    out = torch.empty(num_groups, 3, dtype=torch.float32, device=x.device)
    for g0, g1 in _chunks(num_groups, group_size):
        lo_block = _group_block(x, g0, g1, group_size, _INF)
        hi_block = _group_block(x, g0, g1, group_size, -_INF)
        mn, mx = lo_block.amin(dim=1), hi_block.amax(dim=1)
        is_zero = lo_block == 0
        neg_zero = (is_zero & torch.signbit(lo_block)).any(dim=1)
        pos_zero = (is_zero & ~torch.signbit(lo_block)).any(dim=1)
        out[g0:g1, 0] = torch.where(mn == 0, torch.where(neg_zero, -0.0, 0.0), mn)
        out[g0:g1, 1] = torch.where(mx == 0, torch.where(pos_zero, 0.0, -0.0), mx)
        out[g0:g1, 2] = torch.where(lo_block > 0, lo_block, _INF).amin(dim=1)
    return out


def _bf16_round_up(v: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the smallest bfloat16 >= it (inf and NaN stay inf and NaN)."""
    bits = v.contiguous().view(torch.int32).to(torch.int64)
    up = torch.where(torch.isfinite(v), (bits + 0xFFFF) >> 16, bits >> 16)
    return up.to(torch.int16).view(torch.bfloat16)


def group_params(stats: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo float32, scale bfloat16)`` per group from ``group_minmax`` stats (see ``layout.py``).

    A step below the smallest normal float32 is stored as 0 (``NOTE [ Tiny steps ]``)."""
    levels = (1 << bits) - 1
    mn, mx, min_pos = stats[:, 0], stats[:, 1], stats[:, 2]
    zero_exact = (mn == 0) & (mx > 0)
    if levels >= 2:
        lo_zero = min_pos
        step_zero = (mx - min_pos) / (levels - 1)
    else:
        lo_zero = (min_pos + mx) * 0.5
        step_zero = torch.zeros_like(mx)
    lo = torch.where(zero_exact, lo_zero, mn)
    step = torch.where(zero_exact, step_zero, (mx - mn) / levels)
    step = torch.where((step > 0) & (step < _MIN_NORMAL), 0.0, step)
    scale = _bf16_round_up(step)
    scale = torch.where(zero_exact, -scale, scale)
    return lo.contiguous(), scale.contiguous()


# NOTE [ Tiny steps ]
# A group whose step ((max - min) / L, or (max - min positive) / (L - 1) in zero-exact mode) is a
# float32 subnormal cannot use it: bfloat16 keeps fewer than 8 significant bits below 2**-126 (the
# rounded-up step may exceed the group's whole range many times over), and ``1 / step`` overflows to
# inf below 2**-128, so every code saturates and, in zero-exact mode, ``0 * inf`` sends the smallest
# positive value to code 0, i.e. to 0. Such a step is stored as 0 instead: the group becomes a
# constant group (plain: every value decodes to the min; zero-exact: every positive value to the
# smallest positive one, zeros stay 0). The error stays below the group's range (< L * 2**-126) and
# masks stay exact, at the price of a bias below L * 2**-126 for these groups only. Every group with a
# normal step keeps its bytes.


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2**32`` for int64 ``h`` in [0, 2**32), without signed overflow."""
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def uniform_noise(index: torch.Tensor, seed: int) -> torch.Tensor:
    """float32 ``u`` in [0, 1) for int64 value indices (vectorised ``layout.uniform_noise``)."""
    h = (index & MASK32) ^ (seed & MASK32)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (2.0**-24)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., G] -> uint8 bytes [..., G * bits / 8], LSB first."""
    per_byte = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per_byte)
    out = c[..., 0].clone()
    for k in range(1, per_byte):
        out |= c[..., k] << (k * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 bytes [..., B] -> uint8 codes [..., B * 8 / bits] (inverse of ``pack_codes``)."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)


def grid_widths(grid: torch.Tensor) -> torch.Tensor:
    """``w[k] = 1 / (g[k + 1] - g[k])`` of a fitted grid, float32 (``layout.py``)."""
    return 1.0 / (grid[1:] - grid[:-1])


def grid_position(t: torch.Tensor, grid: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """``t`` (in steps) as a position on ``grid``: ``k + (t - g[k]) * w[k]``, float32 (``layout.py``)."""
    k = (t[..., None] >= grid[1:-1]).sum(-1)
    return k.to(torch.float32) + (t - grid[k]) * widths[k]


def quantize_pack(
    x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat float ``x`` -> ``(codes uint8 [num_groups, G*bits/8], lo float32, scale bfloat16)``; with
    ``grid``, plain groups round onto that fitted grid (``layout.py``)."""
    x = x.reshape(-1)
    layout = PackedLayout(bits, group_size, x.numel())
    levels = layout.levels
    lo, scale = group_params(group_minmax(x, group_size), bits)
    codes = torch.empty(layout.num_groups, layout.bytes_per_group, dtype=torch.uint8, device=x.device)
    step = scale.to(torch.float32).abs()
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    zero_exact = torch.signbit(scale)
    on_grid = ~zero_exact & torch.isfinite(lo) & torch.isfinite(step)
    widths = grid_widths(grid) if grid is not None else None
    for g0, g1 in _chunks(layout.num_groups, group_size):
        block = _group_block(x, g0, g1, group_size, 0.0)
        index = torch.arange(g0 * group_size, g1 * group_size, dtype=torch.int64, device=x.device)
        u = uniform_noise(index, seed).view_as(block)
        t = (block - lo[g0:g1, None]) * inv[g0:g1, None]
        r = torch.floor(t + u)
        plain = r.clamp(0, levels)
        if grid is not None:
            fitted = torch.floor(grid_position(t, grid, widths) + u).clamp(0, levels)
            plain = torch.where(on_grid[g0:g1, None], fitted, plain)
        zero = torch.where(block == 0, 0.0, r.clamp(0, levels - 1) + 1)
        c = torch.where(zero_exact[g0:g1, None], zero, plain)
        c = torch.where(index.view_as(block) < x.numel(), c, 0.0)
        codes[g0:g1] = pack_codes(c.to(torch.uint8), bits)
    return codes, lo, scale


def seeded(
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``quantize_pack_seeded`` of a backend from its ``quantize_pack``: the seed is read from its 0-d
    tensor (on the CPU: no device synchronisation) and the bytes are ``quantize``'s."""

    def quantize_pack_seeded(
        x: torch.Tensor, bits: int, group_size: int, seed: torch.Tensor, grid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``quantize_pack(x, bits, group_size, int(seed), grid)``."""
        return quantize(x, bits, group_size, int(seed), grid)

    return quantize_pack_seeded


quantize_pack_seeded = seeded(quantize_pack)


def unpack_dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
    grid: torch.Tensor | None = None,
) -> None:
    """``unpack_dequantize`` written into the flat tensor ``out``, whose numel and dtype say what to decode."""
    layout = PackedLayout(bits, group_size, out.numel())
    step = scale.to(torch.float32).abs()
    zero_exact = torch.signbit(scale)
    shift = zero_exact.to(torch.float32)
    on_grid = ~zero_exact & torch.isfinite(lo) & torch.isfinite(step)
    for g0, g1 in _chunks(layout.num_groups, group_size):
        raw = unpack_codes(codes[g0:g1], bits)
        c = raw.to(torch.float32)
        if grid is not None:
            c = torch.where(on_grid[g0:g1, None], grid[raw.long()], c)
        v = lo[g0:g1, None] + (c - shift[g0:g1, None]) * step[g0:g1, None]
        v = torch.where(zero_exact[g0:g1, None] & (c == 0), 0.0, v)
        start, stop = g0 * group_size, min(g1 * group_size, layout.numel)
        out[start:stop] = v.view(-1)[: stop - start].to(out.dtype)


def allocating(
    into: Callable[..., None],
    empty: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
) -> Callable[..., torch.Tensor]:
    """``unpack_dequantize`` of a backend from its ``unpack_dequantize_into``: the output comes from
    ``empty(numel, dtype, device)`` (``torch.empty`` by default), then ``into`` decodes into it."""

    def unpack_dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
                          numel: int, dtype: torch.dtype, grid: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of ``quantize_pack``: flat tensor of ``numel`` values of ``dtype``."""
        if empty is None:
            out = torch.empty(numel, dtype=dtype, device=codes.device)
        else:
            out = empty(numel, dtype, codes.device)
        into(out, codes, lo, scale, bits, group_size, grid)
        return out

    return unpack_dequantize


unpack_dequantize = allocating(unpack_dequantize_into)


# NOTE [ The stored order of groups down the columns ]
# ``quantize_pack_columns`` quantizes a ``[rows, cols]`` tensor (``rows`` a multiple of ``group_size``) in
# groups that each hold one column of a block of ``group_size`` rows: its bytes are ``quantize_pack``'s of
# the values in ``columns_first`` order (block after block, and in a block column after column), so the
# layout, the noise index of each value and every decode rule are the row layout's (``layout.py``), and
# a paged record's demotion re-quantizes the stored order group by group like any other. The reference
# composes the reordering with the dispatched row ops (the fast kernels of each device, byte-identical to
# their own references); the CPU and GPU kernels fuse the two (``NOTE [ Column kernels ]`` in ``cpu.py``,
# ``NOTE [ Groups down the columns on a GPU ]`` in ``triton.py``).
def columns_first(x: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """Flat ``x`` viewed as ``[rows, cols]`` in the stored order of ``quantize_pack_columns`` (a copy)."""
    return x.reshape(-1, group_size, cols).transpose(1, 2).reshape(-1)


def quantize_pack_columns(
    x: torch.Tensor, cols: int, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_pack`` of ``x`` (``[rows, cols]`` row after row) in groups down its columns."""
    return torch.ops.daftrain.quantize_pack(columns_first(x, cols, group_size), bits, group_size, seed, grid)


def unpack_dequantize_columns_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, cols: int, bits: int,
    group_size: int, grid: torch.Tensor | None = None,
) -> None:
    """Decode what ``quantize_pack_columns`` wrote into the flat ``out``, row after row."""
    stored = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, group_size, out.numel(), out.dtype, grid)
    out.view(-1, group_size, cols).copy_(stored.view(-1, cols, group_size).transpose(1, 2))


def pack_bool(x: torch.Tensor) -> torch.Tensor:
    """Flat bool -> uint8 [ceil(n/8)], value i at bit i % 8 of byte i // 8."""
    x = x.reshape(-1)
    pad = -x.numel() % 8
    c = x.to(torch.uint8)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    return pack_codes(c.view(1, -1), 1).view(-1)


def unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``pack_bool``."""
    return unpack_codes(packed.view(1, -1), 1).view(-1)[:numel].to(torch.bool)
