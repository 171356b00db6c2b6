"""Compress the saved activations of every training forward of a module, without touching the loop."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ArgumentTypeError, UnsupportedError
from ..saved import compress
from ..saved.checkpoint import compress_recomputation, restore_recomputation

__all__ = ["compress_forward"]


# NOTE [ Compressing a module's forward ]
# Trainers own the loop, so daftrain cannot put ``with ctx:`` around the forward itself. Wrapping the
# module's ``forward`` (the instance attribute, so one module is affected, and distributed wrappers
# such as DDP, which call ``module.forward``, see the wrapped one) enters the context for exactly one
# forward, which is a step of the context (stats, bit allocation, pool step), and leaves it before the
# trainer's backward. Forwards that save nothing (evaluation, ``no_grad``) skip the context, so they
# neither count as steps nor pay for it.
#
# NOTE [ A compressed forward under torch.compile ]
# A compiled module (``torch.compile(model)``, ``Trainer(args=TrainingArguments(torch_compile=True))``) calls
# the wrapped ``forward`` from inside the frame Dynamo traces. Traced, ``with ctx:`` put the context's own entry
# and exit into what Dynamo compiles: a graph break inside ``__enter__`` (it reads the saved-tensor hook stack),
# its remainder compiled as frames of their own, guards on the context's state. So the wrapper is not traced
# (``torch.compiler.disable(recursive=False)``), the context's entry and exit run eagerly (disabled with what
# they call), and the original ``forward`` the wrapper calls is compiled as its own frame, with the context's
# hooks on the stack as in ``with ctx: compiled(x)``; where Dynamo compiles no frame of it (torch.nn's own
# modules), it runs eagerly under the context (``NOTE [ Callbacks in a compiled function's eager code ]``).
#
# Hugging Face models with gradient checkpointing enabled (before this call, as ``Trainer`` does before
# its callbacks' ``on_train_begin``) have their layers' checkpointing swapped for daftrain's for as long as the
# wrapping lasts (``NOTE [ Hugging Face layers checkpointed under compress ]`` in ``saved/checkpoint.py``).
@torch.compiler.disable  # NOTE [ A compressed forward under torch.compile ]
def _enter(ctx: compress) -> None:
    ctx.__enter__()


@torch.compiler.disable
def _exit(ctx: compress, exc: BaseException | None) -> None:
    ctx.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)


def compress_forward(module: nn.Module, ctx: compress) -> Callable[[], None]:
    """Run every training forward of ``module`` under ``ctx``; returns a function that undoes it."""
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(ctx, compress):
        raise ArgumentTypeError(f"ctx must be a daftrain.compress context, got {type(ctx).__name__}")
    if getattr(module.forward, "__daftrain_ctx__", None) is not None:
        raise UnsupportedError("this module's forward is already compressed by daftrain: undo that first "
                               "(call the function compress_forward returned) or reuse its context")
    original = module.forward
    had_instance_attr = "forward" in module.__dict__

    @functools.wraps(original)
    def entered(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        _enter(ctx)  # NOTE [ A compressed forward under torch.compile ]
        try:
            out = original(*args, **kwargs)
        except BaseException as exc:
            _exit(ctx, exc)
            raise
        _exit(ctx, None)
        return out

    forward = torch.compiler.disable(entered, recursive=False)
    forward.__daftrain_ctx__ = ctx  # type: ignore[attr-defined]
    module.forward = forward  # type: ignore[method-assign]
    swapped = compress_recomputation(module, ctx)

    def undo() -> None:
        restore_recomputation(swapped)
        if had_instance_attr:
            module.forward = original  # type: ignore[method-assign]
        else:
            module.__dict__.pop("forward", None)

    return undo
