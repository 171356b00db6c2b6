"""Saved-tensor hook contexts nest, and only the innermost applies: detecting ``compress`` entered
inside another one (``save_on_cpu``, a checkpointed region, another ``compress``)."""

from __future__ import annotations

import inspect
import sys
import types
import warnings
import weakref
from collections import Counter
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["CHECKPOINT_INPUT", "CUSTOM_SHARE_WARNED", "CustomFunctionWarning", "NestedSavedTensorsHooksWarning",
           "outer_hook_name", "saves_reach_daftrain", "saving_function", "warn_custom_functions_kept",
           "warn_if_nested"]


class NestedSavedTensorsHooksWarning(UserWarning):
    """``compress`` was entered inside another saved-tensor hook context, which it then replaces."""


class CustomFunctionWarning(UserWarning):
    """Much of what a forward saved came from custom ``torch.autograd.Function``s, whose saves ``compress`` keeps
    exact (``CompressionConfig.quantize_custom_functions``)."""


# NOTE [ Only the innermost saved-tensor hooks apply ]
# PyTorch keeps a stack of default saved-tensor hooks and calls only the top pair: a context entered
# inside another one silently disables the outer one for every tensor saved while it is active. For
# ``compress`` inside ``save_on_cpu`` the tensors stay in device memory (compressed); inside a
# non-reentrant ``torch.utils.checkpoint`` region the region's tensors are stored (compressed)
# instead of recomputed, so checkpointing saves nothing there. Neither fails, so ``compress`` warns
# once per context when it is entered with another pair on the stack, naming that pair's pack hook.
# The opposite nesting (another context inside ``compress``) is invisible to ``compress``: its pack
# hook is simply not called there (docs/saved.md, "Composition").
_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def outer_hook_name() -> str | None:
    """The qualified name of the pack hook on top of the saved-tensor hook stack, or None if empty."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if top is None:
        return None
    pack = top[0]
    owner = getattr(pack, "__self__", None)  # a bound method: name its class
    if owner is None and hasattr(pack, "__qualname__"):  # a function
        name = f"{pack.__module__}.{pack.__qualname__}"
    else:  # a callable object (compress's hooks are GraphModules, each of a class made for it): its first own class
        cls = next((c for c in type(owner if owner is not None else pack).__mro__
                    if not c.__module__.startswith("torch.fx")), type(pack))
        name = f"{cls.__module__}.{cls.__qualname__}"
    return "daftrain.compress" if name.startswith("daftrain.saved.") else name


def warn_if_nested(ctx: Any) -> None:
    """Warn (once per ``ctx``) if another saved-tensor hook context is active; call before pushing."""
    name = outer_hook_name()
    if name is None or ctx in _warned:
        return
    _warned.add(ctx)
    warnings.warn(
        f"daftrain.compress entered inside another saved-tensor hook context ({name}); PyTorch applies only "
        "the innermost, so that context does nothing for the tensors saved inside compress (save_on_cpu keeps "
        "them in place, a torch.utils.checkpoint region stores them instead of recomputing). Enter compress "
        "outside it, around the whole forward", NestedSavedTensorsHooksWarning, stacklevel=3)


def saves_reach_daftrain() -> bool:
    """Whether a tensor saved now goes to daftrain's hooks (``compress``'s, or a ``daftrain.checkpoint`` region's,
    whose recomputation runs under the op rules) or to none: not to another context's (``NOTE [ Operator-level
    savings under other hooks ]`` in ``op_rules.py``)."""
    return outer_hook_name() in (None, "daftrain.compress")


# NOTE [ A checkpointed region's inputs are kept exact ]
# A ``torch.utils.checkpoint`` region inside ``compress`` (Hugging Face's gradient checkpointing is one per layer)
# saves its inputs through compress's hooks (its own hooks take only the saves inside the region) and recomputes
# the region from them in backward. Quantized, the region is recomputed at a rounded input: every activation the
# recomputation makes, and every gradient inside the region, moves with that rounding through the region's
# nonlinearities (SwinV2 at 4 bits with every layer checkpointed: gradient cosine 0.949, against 0.983 with no
# checkpointing and the same rounding of every activation; T5 0.959 against 0.988). ``daftrain.checkpoint`` keeps
# its inputs exact, the checkpoint boundary; these are kept exact as well. The pack hook sees neither the saving
# node (a custom Function's) nor a torch function in progress, so the frames that called it tell: PyTorch's
# ``_CheckpointFrame.save_inputs`` (non-reentrant), or ``Function.apply`` called by ``checkpoint`` itself
# (reentrant: its forward ran without grad, and what it saves are the region's inputs). Where this PyTorch has
# neither by those names, the inputs are stored as any tensor.
def _checkpoint_codes() -> tuple[frozenset[types.CodeType], types.CodeType | None, types.CodeType | None]:
    save_inputs = getattr(getattr(torch.utils.checkpoint, "_CheckpointFrame", None), "save_inputs", None)
    saves: frozenset[types.CodeType] = frozenset()
    if isinstance(save_inputs, types.FunctionType):  # its comprehension is a code object of its own before 3.12
        code = save_inputs.__code__
        saves = frozenset({code, *(c for c in code.co_consts if isinstance(c, types.CodeType))})
    caller = getattr(inspect.unwrap(torch.utils.checkpoint.checkpoint), "__code__", None)
    apply = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)
    return saves, caller, apply


_SAVES_INPUTS, _CHECKPOINT, _APPLY = _checkpoint_codes()
_MAX_FRAMES = 12
"""How far above the pack hook's frame to look: the hook's own frames and PyTorch's wrappers of it."""


CHECKPOINT_INPUT = "torch.utils.checkpoint"
"""What ``saving_function`` answers for a ``torch.utils.checkpoint`` region's inputs."""


# NOTE [ Saves of custom Functions are kept ]
# What a custom ``torch.autograd.Function`` saves with ``ctx.save_for_backward`` goes through the same hooks as
# autograd's own saves, but its backward is the author's code: the op rules, which keep or encode what autograd's
# backward formulas divide by, compare or exponentiate, know nothing of it. A straight-through clip written as a
# Function (``backward: g * (x >= lo)``) flips where a rounded save crosses its threshold, at any bits (docs/saved.md);
# a bound on a square root's derivative (RecurrentGemma's ``SqrtBoundDerivative``) divides by what it saved, a fused
# kernel's log-sum-exp is exponentiated. So a custom Function's floating-point saves are kept exact unless
# ``quantize_custom_functions`` is set; bool and integer saves are still packed (losslessly), and daftrain's own
# Functions, whose saves are chosen for their rules, are quantized as designed. The Function is found as the
# checkpoint's is: ``Function.apply``'s frame above the pack hook, whose ``cls`` is the Function.
def saving_function() -> type | str | None:
    """Who saves the tensor being packed now where autograd's own formulas do not: ``CHECKPOINT_INPUT`` for a
    ``torch.utils.checkpoint`` region's inputs (``NOTE [ A checkpointed region's inputs are kept exact ]``), a
    custom ``torch.autograd.Function``'s class (``NOTE [ Saves of custom Functions are kept ]``), else None."""
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code in _SAVES_INPUTS:
            return CHECKPOINT_INPUT
        if code is _APPLY:  # the custom Function whose saves these are: checkpoint's own, or another's
            if frame.f_back is not None and frame.f_back.f_code is _CHECKPOINT:
                return CHECKPOINT_INPUT
            function = frame.f_locals.get("cls")
            return function if isinstance(function, type) else None
        frame = frame.f_back
    return None


CUSTOM_SHARE_WARNED = 0.25
"""The share of a forward's saved bytes kept for custom Functions above which ``compress`` warns, once."""


def warn_custom_functions_kept(kept_bytes: Counter[str], saved_bytes: int) -> None:
    """Say that custom Functions' saves, ``kept_bytes`` by Function name, were a large share of ``saved_bytes``."""
    names = ", ".join(f"{name} {n / 2**20:.1f} MiB" for name, n in kept_bytes.most_common(4))
    warnings.warn(
        f"daftrain.compress kept {kept_bytes.total() / 2**20:.1f} MiB of the {saved_bytes / 2**20:.1f} MiB this "
        f"forward saved exact: what custom torch.autograd.Functions saved ({names}), whose backward the op rules "
        "cannot read. If their backward tolerates rounded inputs, pass quantize_custom_functions=True to compress "
        "them too.", CustomFunctionWarning, stacklevel=3)
