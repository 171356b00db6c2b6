"""daftrain's kernels as ``torch.library`` custom ops.

Each op is defined once here with its schema and a fake (meta) implementation; the pure PyTorch
reference in ``kernels/reference.py`` is registered for every device and is the spec. Fast kernels
register themselves for their device key beside it (``kernels/cpu.py``, ``kernels/triton.py``) and
must be byte-identical to the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..layout import QUANTIZABLE_DTYPES, PackedLayout, bool_nbytes
from . import reference

__all__ = [
    "ARGUMENT_CHECKS", "group_minmax", "pack_bool", "quantize_pack", "unpack_bool", "unpack_dequantize",
    "unpack_dequantize_into",
]

# NOTE [ Op registration ]
# The ops are defined on a ``torch.library.Library`` from schema strings, not with
# ``torch.library.custom_op``: a call then goes from PyTorch's C++ dispatcher straight to one Python
# kernel. custom_op adds Python autograd and ADInplaceOrView layers to every call: 11-16 us in a tight
# loop, and 65-110 us for a decode of 4 Mi values (after a kernel that streamed 16 MB the interpreter's
# own working set is out of cache), a quarter of that decode's time. The reference is each op's
# ``CompositeExplicitAutograd`` kernel (every device), the fast kernels register per device key beside
# it, and ``register_fake`` gives the meta kernel. Without custom_op's ADInplaceOrView layer nothing
# bumps the version counter of a mutated argument: the reference writes with PyTorch ops, which bump it,
# and the registry bumps it after a fast kernel wrote through a raw pointer (``mutated_positions``).
# ``torch.library.opcheck`` checks the schema, fake kernel and mutation.
_LIB = torch.library.Library("daftrain", "DEF")


class _Op:
    """A ``daftrain::`` operator defined by ``schema``; calling it dispatches through ``torch.ops``."""

    def __init__(self, schema: str, reference_kernel: Callable[..., Any]) -> None:
        self.name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(self.name, reference_kernel, "CompositeExplicitAutograd")
        self.default = getattr(torch.ops.daftrain, self.name).default
        functools.update_wrapper(self, reference_kernel)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(f"daftrain::{self.name}", fn, lib=_LIB)
        return fn


def _op(schema: str) -> Callable[[Callable[..., Any]], _Op]:
    return lambda reference_kernel: _Op(schema, reference_kernel)


def mutated_positions(name: str) -> tuple[int, ...]:
    """Positions of the arguments op ``name`` writes into: its schema's ``Tensor(a!)``."""
    arguments = getattr(torch.ops.daftrain, name).default._schema.arguments
    return tuple(i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)


def _check_float(x: torch.Tensor) -> None:
    torch._check(
        x.dtype in QUANTIZABLE_DTYPES,
        lambda: f"daftrain quantizes float32, float16 and bfloat16 tensors, got {x.dtype}",
    )


def _check_group(group_size: int) -> None:
    PackedLayout(8, group_size, 0)  # raises LayoutError (a ValueError) for a bad group size


def _check_group_minmax(x: torch.Tensor, group_size: int) -> None:
    _check_float(x)
    _check_group(group_size)


def _check_quantize_pack(x: torch.Tensor, bits: int, group_size: int, seed: int) -> None:
    _check_float(x)
    PackedLayout(bits, group_size, x.numel())


def _check_pack_bool(x: torch.Tensor) -> None:
    torch._check(x.dtype == torch.bool, lambda: f"pack_bool takes a bool tensor, got {x.dtype}")


def _check_unpack_bool(packed: torch.Tensor, numel: int) -> None:
    torch._check(
        numel >= 0 and packed.dtype == torch.uint8 and packed.numel() == bool_nbytes(numel),
        lambda: f"packed must be uint8 [{bool_nbytes(numel)}], got {packed.dtype} [{packed.numel()}]",
    )


@_op("group_minmax(Tensor x, int group_size) -> Tensor")
def group_minmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group ``[min, max, min positive]`` of flat ``x`` as float32 [num_groups, 3]."""
    _check_group_minmax(x, group_size)
    return reference.group_minmax(x, group_size)


@group_minmax.register_fake
def _(x: torch.Tensor, group_size: int) -> torch.Tensor:
    _check_float(x)
    return x.new_empty(-(-x.numel() // group_size), 3, dtype=torch.float32)


@_op("quantize_pack(Tensor x, int bits, int group_size, int seed) -> (Tensor, Tensor, Tensor)")
def quantize_pack(
    x: torch.Tensor, bits: int, group_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize flat ``x`` per group with stochastic rounding and bit-pack it.

    Returns ``(codes uint8 [num_groups, group_size*bits/8], lo float32 [num_groups],
    scale bfloat16 [num_groups])`` in the unified layout (``layout.py``).
    """
    _check_quantize_pack(x, bits, group_size, seed)
    return reference.quantize_pack(x, bits, group_size, seed)


@quantize_pack.register_fake
def _(x: torch.Tensor, bits: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_float(x)
    layout = PackedLayout(bits, group_size, x.numel())
    return (
        x.new_empty(layout.num_groups, layout.bytes_per_group, dtype=torch.uint8),
        x.new_empty(layout.num_groups, dtype=torch.float32),
        x.new_empty(layout.num_groups, dtype=torch.bfloat16),
    )


@_op("unpack_dequantize(Tensor codes, Tensor lo, Tensor scale, int bits, int group_size, int numel, "
     "ScalarType dtype) -> Tensor")
def unpack_dequantize(
    codes: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode what ``quantize_pack`` wrote into a flat tensor of ``numel`` values of ``dtype``."""
    _check_unpack(codes, lo, scale, bits, group_size, numel, dtype)
    return reference.unpack_dequantize(codes, lo, scale, bits, group_size, numel, dtype)


@unpack_dequantize.register_fake
def _(codes, lo, scale, bits, group_size, numel, dtype):  # type: ignore[no-untyped-def]
    _check_unpack(codes, lo, scale, bits, group_size, numel, dtype)
    return codes.new_empty(numel, dtype=dtype)


@_op("unpack_dequantize_into(Tensor(a!) out, Tensor codes, Tensor lo, Tensor scale, int bits, int group_size) -> ()")
def unpack_dequantize_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int
) -> None:
    """``unpack_dequantize`` into the preallocated contiguous 1-D ``out`` (its numel and dtype say what
    to decode): backward reuses its decode buffers instead of faulting in fresh memory every time."""
    _check_unpack_into(out, codes, lo, scale, bits, group_size)
    reference.unpack_dequantize_into(out, codes, lo, scale, bits, group_size)  # its writes bump out's version


@unpack_dequantize_into.register_fake
def _(out, codes, lo, scale, bits, group_size):  # type: ignore[no-untyped-def]
    _check_unpack_into(out, codes, lo, scale, bits, group_size)


def _check_unpack_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int
) -> None:
    torch._check(
        out.dim() == 1 and out.is_contiguous() and out.device == codes.device,
        lambda: f"out must be a contiguous 1-D tensor on {codes.device}, got {out.dim()}-D on {out.device}",
    )
    _check_unpack(codes, lo, scale, bits, group_size, out.numel(), out.dtype)


def _check_unpack(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, numel: int,
    dtype: torch.dtype,
) -> None:
    layout = PackedLayout(bits, group_size, numel)
    torch._check(dtype in QUANTIZABLE_DTYPES, lambda: f"cannot dequantize to {dtype}")
    torch._check(
        codes.dtype == torch.uint8 and tuple(codes.shape) == (layout.num_groups, layout.bytes_per_group),
        lambda: f"codes must be uint8 {(layout.num_groups, layout.bytes_per_group)}, got {codes.dtype} "
        f"{tuple(codes.shape)}",
    )
    torch._check(
        lo.dtype == torch.float32 and tuple(lo.shape) == (layout.num_groups,),
        lambda: f"lo must be float32 [{layout.num_groups}], got {lo.dtype} {tuple(lo.shape)}",
    )
    torch._check(
        scale.dtype == torch.bfloat16 and tuple(scale.shape) == (layout.num_groups,),
        lambda: f"scale must be bfloat16 [{layout.num_groups}], got {scale.dtype} {tuple(scale.shape)}",
    )


@_op("pack_bool(Tensor x) -> Tensor")
def pack_bool(x: torch.Tensor) -> torch.Tensor:
    """Flat bool tensor -> uint8 [ceil(n/8)], 1 bit per value, LSB first."""
    _check_pack_bool(x)
    return reference.pack_bool(x)


@pack_bool.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(bool_nbytes(x.numel()), dtype=torch.uint8)


@_op("unpack_bool(Tensor packed, int numel) -> Tensor")
def unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``pack_bool``."""
    _check_unpack_bool(packed, numel)
    return reference.unpack_bool(packed, numel)


@unpack_bool.register_fake
def _(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return packed.new_empty(numel, dtype=torch.bool)


# NOTE [ Argument checks run before every kernel ]
# A kernel registered for a device key replaces the op's Python body above, and the fast kernels
# trust their sizes (no bounds checks). So the registry (``kernels/registry.py``) calls these same
# checks, with the op's own arguments, before any fast kernel runs: one definition, every backend.
ARGUMENT_CHECKS = {
    "group_minmax": _check_group_minmax,
    "quantize_pack": _check_quantize_pack,
    "unpack_dequantize": _check_unpack,
    "unpack_dequantize_into": _check_unpack_into,
    "pack_bool": _check_pack_bool,
    "unpack_bool": _check_unpack_bool,
}
