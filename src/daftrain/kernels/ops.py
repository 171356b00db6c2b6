"""daftrain's kernels as ``torch.library`` custom ops: the one op table.

Each op is defined once here, as an ``Op``: its schema, its argument check, its fake (meta) kernel
and its pure PyTorch reference (``kernels/reference.py``, the spec), which is registered for every
device. ``OPS`` lists them by name; the fast kernels (``kernels/cpu.py``, ``kernels/triton.py``)
register beside the reference for their device key through ``kernels/registry.py``, which iterates
``OPS``, and must be byte-identical to the reference. The check runs once per call, at the op
boundary (``Op.at_boundary``), whichever kernel the dispatcher picks; the kernels trust it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..layout import QUANTIZABLE_DTYPES, PackedLayout, bool_nbytes, check_grid
from . import reference

__all__ = [
    "OPS", "KernelArgumentError", "KernelDtypeError", "Op", "group_minmax", "pack_bool", "quantize_pack",
    "quantize_pack_columns", "quantize_pack_seeded", "unpack_bool", "unpack_dequantize",
    "unpack_dequantize_columns_into", "unpack_dequantize_into",
]


class KernelArgumentError(InvalidArgumentError, RuntimeError):
    """An op argument of the wrong shape, size or device; the message names it. (Also a
    ``RuntimeError``, what ``torch._check`` raised for these before.)"""


class KernelDtypeError(ArgumentTypeError, RuntimeError):
    """An op argument of a dtype the op cannot take; the message names it and the dtypes it takes."""


# NOTE [ Op registration ]
# The ops are defined on a ``torch.library.Library`` from schema strings, not with
# ``torch.library.custom_op``: a call then goes from PyTorch's C++ dispatcher straight to one Python
# kernel, where custom_op adds Python autograd and ADInplaceOrView layers to every call (their cost is
# in docs/kernels.md). The reference is each op's ``CompositeExplicitAutograd`` kernel (every device),
# the fast kernels register per device key beside it, and ``register_fake`` gives the meta kernel.
# Without custom_op's ADInplaceOrView layer nothing bumps the version counter of a mutated argument:
# the reference writes with PyTorch ops, which bump it, and the registry bumps it after a fast kernel
# wrote through a raw pointer (``Op.mutated``). ``torch.library.opcheck`` checks the schema, fake
# kernel and mutation.
_LIB = torch.library.Library("daftrain", "DEF")

class Op:
    """A ``daftrain::`` operator: calling it runs ``torch.ops.daftrain``'s op, on a plain tensor outside any
    tracing as a direct call of its device's kernel (``NOTE [ Eager calls skip the dispatcher ]``).

    ``check(*args)`` validates the op's arguments (raises a ``DaftrainError``), ``fake`` computes the
    output metadata, ``reference`` is the spec. Defining one registers it and adds it to ``OPS``.
    """

    def __init__(self, schema: str, *, check: Callable[..., None], fake: Callable[..., Any],
                 reference: Callable[..., Any]) -> None:
        self.name = schema.split("(", 1)[0]
        self.check = check
        self.reference = reference
        _LIB.define(schema)
        _LIB.impl(self.name, self.at_boundary(reference), "CompositeExplicitAutograd")
        torch.library.register_fake(f"daftrain::{self.name}", self.at_boundary(fake), lib=_LIB)
        self.default = getattr(torch.ops.daftrain, self.name).default
        arguments = self.default._schema.arguments
        self.mutated = tuple(i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write)
        """Positions of the arguments the op writes into: its schema's ``Tensor(a!)``."""
        self.eager_kernels: dict[str, Callable[..., Any]] = {}
        """The checked fast kernel per device type, which eager calls reach without the dispatcher (``NOTE [
        Eager calls skip the dispatcher ]``); ``kernels/registry.py`` fills it as it registers them."""
        functools.update_wrapper(self, reference)
        OPS[self.name] = self

    def at_boundary(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        """``kernel`` preceded by this op's argument check: how every kernel of the op is registered."""

        @functools.wraps(kernel)
        def checked(*args: Any, **kwargs: Any) -> Any:
            self.check(*args, **kwargs)
            return kernel(*args, **kwargs)

        return checked

    # NOTE [ Eager calls skip the dispatcher ]
    # A call on a plain tensor, outside any tracing and with no ``TorchDispatchMode`` active, runs the
    # kernel the dispatcher would pick for its device (the same checked function it has registered) directly:
    # the dispatcher's way to a Python kernel (into C++, boxing the arguments, back into Python) costs more
    # host time than the kernel itself on a small record, and the hooks call these ops once or twice for
    # every tensor they save. Anything else goes through the dispatcher: a fake or functional tensor, any
    # dispatch mode (``FakeTensorMode``, a flop counter, ``torch.compile``'s tracing), a device whose fast
    # kernels are not loaded (the reference runs there). A ``TorchFunctionMode`` does not see these calls.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        kernel = self.eager_kernels.get(first.device.type) if type(first) is torch.Tensor else None
        if kernel is None or torch._C._len_torch_dispatch_stack() or torch._is_functional_tensor(first):
            return self.default(*args, **kwargs)
        return kernel(*args, **kwargs)


OPS: dict[str, Op] = {}
"""Every ``daftrain::`` op by name, in definition order."""


def _require(cond: Any, message: Callable[[], str], error: type[Exception] = KernelArgumentError) -> None:
    if cond is not True:  # a plain bool that holds needs no more; a symbolic one under tracing goes to torch
        torch._check_with(error, cond, message)


def _check_float(x: torch.Tensor) -> None:
    _require(x.dtype in QUANTIZABLE_DTYPES,
             lambda: f"x: daftrain quantizes float32, float16 and bfloat16 tensors, got {x.dtype}",
             KernelDtypeError)


def _check_group_minmax(x: torch.Tensor, group_size: int) -> None:
    _check_float(x)
    PackedLayout(8, group_size, 0)  # raises LayoutError (a ValueError) for a bad group size


def _check_grid(grid: torch.Tensor | None, bits: int, device: torch.device) -> None:
    if grid is not None:
        _require(grid.device == device, lambda: f"grid must be on {device}, got {grid.device}")
        # raises LayoutError (a ValueError); a fake tensor (tracing, the fake kernel) has no values to read
        check_grid(grid, bits, values=type(grid) is torch.Tensor or not is_fake(grid))


def _check_quantize_pack(x: torch.Tensor, bits: int, group_size: int, seed: int,
                         grid: torch.Tensor | None = None) -> None:
    _check_float(x)
    PackedLayout(bits, group_size, x.numel())
    _check_grid(grid, bits, x.device)


def _check_quantize_pack_seeded(x: torch.Tensor, bits: int, group_size: int, seed: torch.Tensor,
                                grid: torch.Tensor | None = None) -> None:
    _check_float(x)
    PackedLayout(bits, group_size, x.numel())
    _check_grid(grid, bits, x.device)
    _require(
        seed.dim() == 0 and seed.dtype == torch.int64 and seed.device.type == "cpu",
        lambda: f"seed must be a 0-d int64 CPU tensor, got {seed.dim()}-d {seed.dtype} on {seed.device}",
    )


def _check_unpack(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, numel: int,
    dtype: torch.dtype, grid: torch.Tensor | None = None,
) -> None:
    layout = PackedLayout(bits, group_size, numel)
    _check_grid(grid, bits, codes.device)
    _require(dtype in QUANTIZABLE_DTYPES,
             lambda: f"cannot dequantize to {dtype}: dtype must be float32, float16 or bfloat16", KernelDtypeError)
    _require(
        codes.dtype == torch.uint8 and tuple(codes.shape) == (layout.num_groups, layout.bytes_per_group),
        lambda: f"codes must be uint8 {(layout.num_groups, layout.bytes_per_group)}, got {codes.dtype} "
        f"{tuple(codes.shape)}",
    )
    _require(
        lo.dtype == torch.float32 and tuple(lo.shape) == (layout.num_groups,),
        lambda: f"lo must be float32 [{layout.num_groups}], got {lo.dtype} {tuple(lo.shape)}",
    )
    _require(
        scale.dtype == torch.bfloat16 and tuple(scale.shape) == (layout.num_groups,),
        lambda: f"scale must be bfloat16 [{layout.num_groups}], got {scale.dtype} {tuple(scale.shape)}",
    )


def _check_unpack_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
    grid: torch.Tensor | None = None,
) -> None:
    _require(
        out.dim() == 1 and out.is_contiguous() and out.device == codes.device,
        lambda: f"out must be a contiguous 1-D tensor on {codes.device}, got {out.dim()}-D on {out.device}",
    )
    _check_unpack(codes, lo, scale, bits, group_size, out.numel(), out.dtype, grid)


def _check_columns(numel: int, cols: int, group_size: int) -> None:
    _require(cols >= 1 and numel % cols == 0 and (numel // cols) % group_size == 0,
             lambda: f"cols must divide the {numel} values into rows whose count is a multiple of group_size "
             f"({group_size}), got cols={cols}: groups down the columns hold group_size rows of one column")


def _check_quantize_pack_columns(x: torch.Tensor, cols: int, bits: int, group_size: int, seed: int,
                                 grid: torch.Tensor | None = None) -> None:
    _check_quantize_pack(x, bits, group_size, seed, grid)
    _check_columns(x.numel(), cols, group_size)


def _check_unpack_columns_into(
    out: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, cols: int, bits: int,
    group_size: int, grid: torch.Tensor | None = None,
) -> None:
    _check_unpack_into(out, codes, lo, scale, bits, group_size, grid)
    _check_columns(out.numel(), cols, group_size)


def _check_pack_bool(x: torch.Tensor) -> None:
    _require(x.dtype == torch.bool, lambda: f"pack_bool takes a bool tensor: x is {x.dtype}", KernelDtypeError)


def _check_unpack_bool(packed: torch.Tensor, numel: int) -> None:
    _require(numel >= 0, lambda: f"numel must be >= 0, got {numel}")
    _require(
        packed.dtype == torch.uint8 and packed.numel() == bool_nbytes(numel),
        lambda: f"packed must be uint8 [{bool_nbytes(numel)}], got {packed.dtype} [{packed.numel()}]",
    )


def _fake_group_minmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty(-(-x.numel() // group_size), 3, dtype=torch.float32)


def _fake_quantize_pack(
    x: torch.Tensor, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = PackedLayout(bits, group_size, x.numel())
    return (
        x.new_empty(layout.num_groups, layout.bytes_per_group, dtype=torch.uint8),
        x.new_empty(layout.num_groups, dtype=torch.float32),
        x.new_empty(layout.num_groups, dtype=torch.bfloat16),
    )


def _fake_quantize_pack_seeded(
    x: torch.Tensor, bits: int, group_size: int, seed: torch.Tensor, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fake_quantize_pack(x, bits, group_size, 0)


def _fake_unpack_dequantize(codes, lo, scale, bits, group_size, numel, dtype, grid=None):  # type: ignore[no-untyped-def]
    return codes.new_empty(numel, dtype=dtype)


def _fake_unpack_dequantize_into(out, codes, lo, scale, bits, group_size, grid=None):  # type: ignore[no-untyped-def]
    return None


def _fake_quantize_pack_columns(
    x: torch.Tensor, cols: int, bits: int, group_size: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fake_quantize_pack(x, bits, group_size, 0)


def _fake_unpack_dequantize_columns_into(out, codes, lo, scale, cols, bits, group_size, grid=None):  # type: ignore[no-untyped-def]
    return None


def _fake_pack_bool(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(bool_nbytes(x.numel()), dtype=torch.uint8)


def _fake_unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return packed.new_empty(numel, dtype=torch.bool)


group_minmax = Op(
    "group_minmax(Tensor x, int group_size) -> Tensor",
    check=_check_group_minmax, fake=_fake_group_minmax, reference=reference.group_minmax,
)
"""Per-group ``[min, max, min positive]`` of flat ``x`` as float32 [num_groups, 3]."""

quantize_pack = Op(
    "quantize_pack(Tensor x, int bits, int group_size, int seed, Tensor? grid=None) -> (Tensor, Tensor, Tensor)",
    check=_check_quantize_pack, fake=_fake_quantize_pack, reference=reference.quantize_pack,
)
"""Quantize flat ``x`` per group with stochastic rounding and bit-pack it: ``(codes uint8
[num_groups, group_size*bits/8], lo float32 [num_groups], scale bfloat16 [num_groups])`` in the
unified layout (``layout.py``); with ``grid`` (float32 ``[2**bits]``, 2 and 4 bits), plain groups round
onto that fitted grid."""

quantize_pack_seeded = Op(
    "quantize_pack_seeded(Tensor x, int bits, int group_size, Tensor seed, Tensor? grid=None) "
    "-> (Tensor, Tensor, Tensor)",
    check=_check_quantize_pack_seeded, fake=_fake_quantize_pack_seeded, reference=reference.quantize_pack_seeded,
)
"""``quantize_pack`` with the seed in a 0-d int64 CPU tensor: the same bytes as ``quantize_pack(x, bits,
group_size, int(seed))``. Inside a compiled graph the seed is drawn by the graph on every call
(``NOTE [ A fresh seed per compiled call ]`` in ``saved/compiled.py``); an ``int`` argument would be a
constant baked into the graph."""

unpack_dequantize = Op(
    "unpack_dequantize(Tensor codes, Tensor lo, Tensor scale, int bits, int group_size, int numel, "
    "ScalarType dtype, Tensor? grid=None) -> Tensor",
    check=_check_unpack, fake=_fake_unpack_dequantize, reference=reference.unpack_dequantize,
)
"""Decode what ``quantize_pack`` wrote (with the same ``grid``) into a flat tensor of ``numel`` values of ``dtype``."""

unpack_dequantize_into = Op(
    "unpack_dequantize_into(Tensor(a!) out, Tensor codes, Tensor lo, Tensor scale, int bits, int group_size, "
    "Tensor? grid=None) -> ()",
    check=_check_unpack_into, fake=_fake_unpack_dequantize_into, reference=reference.unpack_dequantize_into,
)
"""``unpack_dequantize`` into the preallocated contiguous 1-D ``out`` (its numel and dtype say what to
decode): backward reuses its decode buffers instead of faulting in fresh memory every time."""

quantize_pack_columns = Op(
    "quantize_pack_columns(Tensor x, int cols, int bits, int group_size, int seed, Tensor? grid=None) "
    "-> (Tensor, Tensor, Tensor)",
    check=_check_quantize_pack_columns, fake=_fake_quantize_pack_columns, reference=reference.quantize_pack_columns,
)
"""``quantize_pack`` of flat ``x`` viewed as ``[rows, cols]`` (``rows`` a multiple of ``group_size``) in groups
that each hold one column of ``group_size`` rows: the bytes of ``quantize_pack(reference.columns_first(x, cols,
group_size), ...)`` (``NOTE [ The stored order of groups down the columns ]`` in ``reference.py``)."""

unpack_dequantize_columns_into = Op(
    "unpack_dequantize_columns_into(Tensor(a!) out, Tensor codes, Tensor lo, Tensor scale, int cols, int bits, "
    "int group_size, Tensor? grid=None) -> ()",
    check=_check_unpack_columns_into, fake=_fake_unpack_dequantize_columns_into,
    reference=reference.unpack_dequantize_columns_into,
)
"""Decode what ``quantize_pack_columns`` wrote into the preallocated contiguous 1-D ``out``, row after row."""

pack_bool = Op(
    "pack_bool(Tensor x) -> Tensor",
    check=_check_pack_bool, fake=_fake_pack_bool, reference=reference.pack_bool,
)
"""Flat bool tensor -> uint8 [ceil(n/8)], 1 bit per value, LSB first."""

unpack_bool = Op(
    "unpack_bool(Tensor packed, int numel) -> Tensor",
    check=_check_unpack_bool, fake=_fake_unpack_bool, reference=reference.unpack_bool,
)
"""Inverse of ``pack_bool``."""
