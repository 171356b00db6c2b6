"""Checkpointing whose recomputation is stored compressed.

``torch.utils.checkpoint`` recomputes a block in backward and holds every tensor the recomputation
saves exactly, so a checkpointed block's backward peaks at the block's full activations even under
``compress``. ``checkpoint`` here saves nothing in the forward either, and stores what the
recomputation saves through a ``compress`` context, so the block's backward holds its activations
packed and decodes each as its consumer runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from ..errors import ArgumentTypeError, DaftrainError, UnsupportedError
from .records import check_version

if TYPE_CHECKING:  # hooks.py imports this module (compress(model=...) swaps checkpointed layers)
    from .hooks import compress

__all__ = ["RecomputationMismatchError", "checkpoint", "compress_recomputation", "restore_recomputation"]


class RecomputationMismatchError(DaftrainError, RuntimeError):
    """A checkpointed function saved different tensors when recomputed than in its forward."""


# NOTE [ Compressed recomputation ]
# The forward runs ``fn`` under saved-tensor hooks that store a placeholder (the tensor's position,
# shape and dtype) for each saved tensor, and keeps ``fn``'s inputs (detached: exact, as the
# checkpointed boundary) with the RNG and autocast states. The first unpack in backward runs ``fn``
# again from those inputs, with those states, under grad mode and under the recomputation context
# (``compress.recomputation_context()``, entered so that its op rules apply), with hooks that hand each
# saved tensor to that context's pack and keep the packed form by position; each unpack then restores
# its position through the context's unpack and drops it. The recomputation must save the same
# sequence of shapes and dtypes as the forward (``RecomputationMismatchError`` otherwise), as
# ``torch.utils.checkpoint`` requires. Positions never unpacked (a branch backward does not reach)
# are recomputed again on a later backward with ``retain_graph=True``. What the forward computes inside
# a region and does not save is freed there: the forward's context counts each placeholder's bytes
# towards its next heap trim, as its own pack hook counts every saved tensor, and trims when a region
# returns (``NOTE [ Freed memory goes back to the OS ]``); the recomputation's context trims as any does.
class _Frame:
    """One checkpointed call: its inputs, states, placeholders and, after recomputation, packed saves."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 context: compress | None, preserve_rng_state: bool) -> None:
        self.fn, self.kwargs, self.context = fn, kwargs, context
        self.inner = context.recomputation_context() if context is not None else None
        self.args = tuple(_stash(a) for a in args)
        if context is not None:  # the stats count what the checkpoint boundary holds
            for a in args:
                if isinstance(a, torch.Tensor):
                    context._hold_exact(a)
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.devices, self.device_rng = get_device_states(*args) if preserve_rng_state else ([], [])
        self.autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda") if d == "cpu" or torch.cuda.is_available()}
        self.meta: list[tuple[torch.Size, torch.dtype]] = []
        self.saved: dict[int, Any] = {}
        self._next = 0

    def placeholder(self, t: torch.Tensor) -> int:
        if self.context is not None:
            self.context._note_unsaved(t.numel() * t.element_size())
        self.meta.append((t.shape, t.dtype))
        return len(self.meta) - 1

    def unpack(self, position: int) -> torch.Tensor:
        if position not in self.saved:
            self._recompute()
        packed = self.saved.pop(position)
        return self.inner._unpack(packed) if self.inner is not None else packed

    def _store(self, t: torch.Tensor) -> int:
        position, self._next = self._next, self._next + 1
        if position >= len(self.meta) or self.meta[position] != (t.shape, t.dtype):
            expected = self.meta[position] if position < len(self.meta) else "nothing more"
            raise RecomputationMismatchError(
                f"daftrain.checkpoint: the recomputation of {getattr(self.fn, '__name__', self.fn)!r} saved "
                f"tensor {position} as {(tuple(t.shape), t.dtype)}, the forward saved {expected}; the "
                "checkpointed function must run the same ops on recomputation (no data-dependent control flow "
                "or state changed between forward and backward)")
        self.saved[position] = self.inner._pack(t) if self.inner is not None else t.detach()
        return position

    def _recompute(self) -> None:
        args = tuple(_restore(a) for a in self.args)
        self._next = 0
        with torch.random.fork_rng(devices=self.devices, enabled=self.cpu_rng is not None), \
                contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                torch.set_rng_state(self.cpu_rng)
            if self.devices:
                set_device_states(self.devices, self.device_rng)
            stack.enter_context(torch.enable_grad())
            for device, (enabled, dtype) in self.autocast.items():  # the forward's autocast state
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            if self.inner is not None:
                stack.enter_context(self.inner)  # its op rules trace the recomputation's ops
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._store, _never_unpacked))
            self.fn(*args, **self.kwargs)
        if self._next != len(self.meta):
            raise RecomputationMismatchError(
                f"daftrain.checkpoint: the recomputation of {getattr(self.fn, '__name__', self.fn)!r} saved "
                f"{self._next} tensors, the forward {len(self.meta)}; the checkpointed function must run the "
                "same ops on recomputation")


def _never_unpacked(position: int) -> torch.Tensor:
    raise UnsupportedError(
        "daftrain.checkpoint: the checkpointed function runs a backward of its own (e.g. torch.autograd.grad "
        "inside its forward), which its recomputation cannot serve; checkpoint it with torch.utils.checkpoint")


class _Stashed:
    __slots__ = ("requires_grad", "tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.requires_grad, self.version = t.detach(), t.requires_grad, t._version


def _stash(a: Any) -> Any:
    return _Stashed(a) if isinstance(a, torch.Tensor) else a


def _restore(a: Any) -> Any:
    if not isinstance(a, _Stashed):
        return a
    check_version(a.tensor, a.version)  # an input modified in place since the forward
    return a.tensor.detach().requires_grad_(a.requires_grad)


_TORCH_ONLY = ("context_fn", "determinism_check", "debug")


def checkpoint(fn: Callable[..., Any], *args: Any, compression: compress | None = None,
               use_reentrant: bool | None = None, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, saving nothing for backward but its inputs; backward recomputes it and,
    given ``compression`` (the ``compress`` context of the forward), stores what the recomputation
    saves through ``compression.recomputation_context()``. See ``NOTE [ Compressed recomputation ]``.

    A drop-in for ``torch.utils.checkpoint.checkpoint``: ``use_reentrant`` is accepted and the semantics
    are always the non-reentrant ones (``torch.autograd.grad`` works, inputs need not require grad);
    ``preserve_rng_state=False`` skips replaying the random stream."""
    if not callable(fn):
        raise ArgumentTypeError(f"daftrain.checkpoint: fn must be callable, got {type(fn).__name__}")
    if compression is not None and not callable(getattr(compression, "recomputation_context", None)):
        raise ArgumentTypeError(f"daftrain.checkpoint: compression must be a daftrain.compress context or None, "
                                f"got {type(compression).__name__}")
    for name, value in (("use_reentrant", use_reentrant), ("preserve_rng_state", preserve_rng_state)):
        if value is not None and not isinstance(value, bool):
            raise ArgumentTypeError(f"daftrain.checkpoint: {name} must be a bool, got {type(value).__name__}")
    torch_only = sorted(set(kwargs) & set(_TORCH_ONLY))
    if torch_only:
        raise UnsupportedError(f"daftrain.checkpoint does not take {torch_only} (options of torch.utils.checkpoint); "
                               "drop them, or use torch.utils.checkpoint for this region")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs, compression, preserve_rng_state)
    with torch.autograd.graph.saved_tensors_hooks(frame.placeholder, frame.unpack):
        out = fn(*args, **kwargs)
    if compression is not None:
        compression._region_ended()
    return out


# NOTE [ Hugging Face layers checkpointed under compress ]
# A Hugging Face model with gradient checkpointing enabled calls each layer's ``_gradient_checkpointing_func``;
# where that is plain ``torch.utils.checkpoint.checkpoint`` (with at most ``use_reentrant`` given), it is swapped
# for ``checkpoint`` here under the ``compress`` context whose model holds the layer, while that context is
# entered (``compress(model=...)``) or a module's forward is wrapped in it (``compress_forward``): the layers'
# recomputation in backward is stored compressed, under the op rules, and their inputs are kept exact. Left as
# it is, plain checkpointing recomputes each layer exactly and compress stores only the layers' inputs (kept
# exact too: ``NOTE [ A checkpointed region's inputs are kept exact ]`` in ``nesting.py``), which saves little.
# Only the outermost checkpointed layers are swapped (a Swin stage is checkpointed, and so is each of its
# blocks): a recomputation runs after ``compress(model=...)`` has put the functions back, and an inner layer must
# checkpoint the same way then as in the forward, or the recomputation saves other tensors. The layers are
# Hugging Face's ``GradientCheckpointingLayer``s, known by that class's name (no import of ``transformers``);
# a model without them (earlier versions call the function from the enclosing model) has every candidate
# swapped. Any other checkpointing function (offloading, selective checkpointing) is left as it is.
def compress_recomputation(module: nn.Module, ctx: compress) -> list[tuple[nn.Module, Any]]:
    """Swap the plain ``torch.utils.checkpoint`` checkpointing functions of ``module``'s outermost Hugging Face
    checkpointed layers for ``checkpoint`` under ``ctx`` (``NOTE [ Hugging Face layers checkpointed under compress
    ]``); returns each swapped layer with its previous function, for ``restore_recomputation``."""
    if ctx.config.bits is None:
        return []
    candidates = [m for m in module.modules() if "_gradient_checkpointing_func" in m.__dict__]
    layers = [m for m in candidates if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    if layers:
        inner = {id(n) for m in layers for n in m.modules() if n is not m}
        candidates = [m for m in layers if id(m) not in inner]
    candidates = [m for m in candidates if _plain_checkpointing(m.__dict__["_gradient_checkpointing_func"])]
    swapped = [(m, m.__dict__["_gradient_checkpointing_func"]) for m in candidates]
    for m, _ in swapped:
        m._gradient_checkpointing_func = functools.partial(checkpoint, compression=ctx)
    return swapped


def _plain_checkpointing(func: Any) -> bool:
    return func is torch.utils.checkpoint.checkpoint or (
        isinstance(func, functools.partial) and func.func is torch.utils.checkpoint.checkpoint and not func.args
        and set(func.keywords) <= {"use_reentrant"})


def restore_recomputation(swapped: list[tuple[nn.Module, Any]]) -> None:
    """Put back the checkpointing functions ``compress_recomputation`` swapped."""
    for layer, previous in swapped:
        layer._gradient_checkpointing_func = previous
