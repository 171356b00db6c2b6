"""The unified packed layout: the one byte format every backend reads and writes.

A float tensor of ``numel`` values (taken in memory order) is cut into ``num_groups = ceil(numel / G)``
groups of ``G = group_size`` values; the last group may be ragged. Each group stores:

* ``lo``    float32: the value that code ``z`` decodes to (see the two modes below);
* ``scale`` bfloat16: the step between codes, rounded *up* to bfloat16 so that every value of the group
  lies inside ``[lo, lo + (L - z) * |scale|]``; its sign bit selects the mode;
* ``codes`` ``G * bits / 8`` bytes: ``bits``-bit codes, value ``j`` of the group at bit
  ``(j * bits) % 8`` of byte ``(j * bits) // 8``, least significant bit first. Since bits is 1, 2, 4
  or 8 a code never straddles a byte, and since G is a multiple of 32 each group fills whole 32-bit
  words. Codes of the padding past ``numel`` are 0.

with ``L = 2**bits - 1``. The two modes (``z = signbit(scale)``):

* **plain** (``z = 0``): ``lo = min``, ``|scale| >= (max - min) / L``, value = ``lo + c * |scale|``.
* **zero-exact** (``z = 1``, chosen when the group's min is exactly 0 and its max is positive, as in a
  ReLU output): code 0 *is* the value 0 and only 0; a positive value gets a code in ``1..L`` and
  decodes to ``lo + (c - 1) * |scale|`` with ``lo`` = the smallest positive value. No positive value
  becomes 0 and no 0 becomes positive, so ops that rebuild a mask from their saved output (ReLU,
  threshold) get the exact mask. At 1 bit there is a single positive level: ``lo`` is then the
  midpoint of the positive range and the group is *not* elementwise unbiased (the mask stays exact).

**Tiny steps**: a step ((max - min) / L, or (max - lo) / (L - 1) in zero-exact mode, in float32) below
the smallest normal float32, 2**-126, is stored as 0 (keeping the mode's sign): the group then decodes
to ``lo`` (zero-exact: its zeros to 0). Such groups (values within ``L * 2**-126`` of each other) are
off by at most their range and not elementwise unbiased; a subnormal step would lose bfloat16's
precision and overflow ``1 / |scale|`` (``NOTE [ Tiny steps ]`` in ``kernels/reference.py``).

Rounding is stochastic, ``c = clamp(floor(t + u))`` with ``t = (x - lo) * (1 / |scale|)`` evaluated in
float32 (the reciprocal is correctly rounded; no fused multiply-add), and ``u`` a counter-based
uniform: ``u = (fmix32((i mod 2**32) XOR seed) >> 8) * 2**-24`` for the value's index ``i`` in the
tensor, ``fmix32`` being MurmurHash3's finaliser. So ``E[decode(c)] = x`` (tiny steps aside) and the
result depends only on (x, seed), never on the backend or the thread count. Decoding evaluates
``lo + (c - z) * |scale|`` in float32 with two roundings, then casts to the tensor's dtype.

Worked example (``bits=2``, one group, first four values shown)::

    x        = [-1.0, 2.0, 0.0, 1.0, ...]   min -1.0, max 2.0 -> L = 3, scale = (2 - -1) / 3 = 1.0
    lo       = -1.0 -> float32 bytes  00 00 80 bf
    scale    =  1.0 -> bfloat16 bytes 80 3f        (sign bit clear: plain mode)
    codes    = [0, 3, 1, 2]  (values on the grid round the same way whatever u is)
    byte 0   = 0 | 3 << 2 | 1 << 4 | 2 << 6 = 0b10011100 = 0x9c

**Fitted grids** (2 and 4 bits, plain groups): a record may map its codes to levels ``g[0..L]`` that are
not ``0, 1, ..., L``: ascending float32 values in units of the step, ``g[0] = 0`` and ``g[L] = L``, one
grid per record (``L + 1`` float32 values beside the groups). In a plain group whose ``lo`` and step are
finite a value is rounded stochastically between the two levels around it: with ``k`` the number of
``g[1..L-1]`` at or below ``t``, ``c = clamp(floor(k + (t - g[k]) * w[k] + u))`` where
``w[k] = 1 / (g[k + 1] - g[k])`` (correctly rounded, float32, no fused multiply-add), and code ``c``
decodes to ``lo + g[c] * |scale|``. A value between two levels goes to one of them with the
probabilities that keep its mean, so the record is as unbiased as on the uniform grid, with the levels
placed where the record's values are (``NOTE [ Fitted grids ]`` in ``kernels/grids.py``). Zero-exact groups
and groups with a non-finite ``lo`` or step use the uniform grid whatever the record's grid. The uniform
grid ``g[k] = k`` gives the same bytes as no grid.

``tests/test_layout.py`` pins this example and golden vectors of whole records.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError

SUPPORTED_BITS: tuple[int, ...] = (1, 2, 4, 8)
"""Bit-widths a float activation can be quantized to."""

MIN_GROUP_SIZE = 32
MAX_GROUP_SIZE = 1 << 16
"""Group sizes are multiples of 32 in [MIN_GROUP_SIZE, MAX_GROUP_SIZE]: each group's codes fill whole 32-bit words."""

QUANTIZABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

STORED_AS_FLOAT32: tuple[torch.dtype, ...] = (torch.float64,)
"""Float dtypes the saved-tensor hooks quantize through a float32 copy (``NOTE [ Double precision stored through
float32 ]`` in ``saved/hooks.py``); the kernels take ``QUANTIZABLE_DTYPES`` only."""

MASK32 = 0xFFFFFFFF


class LayoutError(InvalidArgumentError):
    """A packed buffer that does not follow the unified layout (bad header, size or checksum)."""


@dataclass(frozen=True)
class PackedLayout:
    """Sizes of one quantized record in the unified layout."""

    bits: int
    group_size: int
    numel: int

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise LayoutError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if not (MIN_GROUP_SIZE <= self.group_size <= MAX_GROUP_SIZE) or self.group_size % 32:
            raise LayoutError(
                f"group_size must be a multiple of 32 in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}], got {self.group_size}"
            )
        if self.numel < 0:
            raise LayoutError(f"numel must be >= 0, got {self.numel}")

    @property
    def levels(self) -> int:
        """``L = 2**bits - 1``, the largest code."""
        return (1 << self.bits) - 1

    @property
    def num_groups(self) -> int:
        return math.ceil(self.numel / self.group_size)

    @property
    def bytes_per_group(self) -> int:
        return self.group_size * self.bits // 8

    @property
    def codes_nbytes(self) -> int:
        return self.num_groups * self.bytes_per_group

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: codes + float32 lo + bfloat16 scale per group."""
        return self.codes_nbytes + self.num_groups * (4 + 2)


GRID_BITS: tuple[int, ...] = (2, 4)
"""Bit-widths whose records may carry a fitted grid (1 bit has no level between its two; 8 bits' levels are
fine enough)."""


def check_grid(grid: torch.Tensor, bits: int, *, values: bool = True) -> None:
    """Raise ``LayoutError`` unless ``grid`` is a fitted grid for ``bits``-bit codes: float32 ``[2**bits]``,
    ascending from exactly 0 to exactly ``2**bits - 1``. With ``values``, the values are read on the CPU
    (never on a device: no sync)."""
    if bits not in GRID_BITS:
        raise LayoutError(f"grid: fitted grids are for {GRID_BITS}-bit codes, got bits={bits}; pass grid=None")
    levels = (1 << bits) - 1
    if grid.dtype != torch.float32 or tuple(grid.shape) != (levels + 1,):
        raise LayoutError(f"grid must be float32 [{levels + 1}] for {bits}-bit codes, got {grid.dtype} "
                          f"{tuple(grid.shape)}")
    if not values or grid.device.type != "cpu":
        return
    at = grid.tolist()  # a few values: Python compares them faster than tensor ops would
    if not (at[0] == 0 and at[-1] == levels and all(a < b for a, b in itertools.pairwise(at))):
        raise LayoutError(f"grid must ascend strictly from 0 to {levels}, got {at}")


def widest_bits_within(avg_bits: float) -> int:
    """The widest supported bit-width not above ``avg_bits`` (at least 1): what an ``avg_bits`` target
    stores where it allocates nothing."""
    return max((b for b in SUPPORTED_BITS if b <= avg_bits), default=SUPPORTED_BITS[0])


def bool_nbytes(numel: int) -> int:
    """Bytes of a bool tensor packed 1 bit per value (LSB first)."""
    return (numel + 7) // 8


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int (the spec of the kernels' noise hash)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    h ^= h >> 16
    return h


def uniform_noise(index: int, seed: int) -> float:
    """The stochastic-rounding offset ``u`` for value ``index`` under ``seed`` (scalar spec)."""
    return (fmix32((index & MASK32) ^ (seed & MASK32)) >> 8) * 2.0**-24


def record_seed(base_seed: int, step: int, record: int) -> int:
    """A 32-bit seed per (base seed, step, record), decorrelated by hashing."""
    h = fmix32(base_seed ^ (base_seed >> 32))
    h = fmix32(h ^ fmix32(step * 0x9E3779B9 + 0x7F4A7C15))
    return fmix32(h ^ fmix32(record * 0x85EBCA77 + 0x165667B1))
