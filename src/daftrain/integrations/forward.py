"""Compress the saved activations of every training forward of a module, without touching the loop."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ArgumentTypeError, UnsupportedError
from ..saved import compress
from ..saved.checkpoint import checkpoint as compressed_checkpoint

__all__ = ["compress_forward"]


# NOTE [ Compressing a module's forward ]
# Trainers own the loop, so daftrain cannot put ``with ctx:`` around the forward itself. Wrapping the
# module's ``forward`` (the instance attribute, so one module is affected, and distributed wrappers
# such as DDP, which call ``module.forward``, see the wrapped one) enters the context for exactly one
# forward, which is a step of the context (stats, bit allocation, pool step), and leaves it before the
# trainer's backward. Forwards that save nothing (evaluation, ``no_grad``) skip the context, so they
# neither count as steps nor pay for it.
#
# Hugging Face models with gradient checkpointing enabled (before this call, as ``Trainer`` does before
# its callbacks' ``on_train_begin``) call each layer's ``_gradient_checkpointing_func``; where that is
# plain ``torch.utils.checkpoint.checkpoint`` (with at most ``use_reentrant`` given), it is swapped for
# ``daftrain.saved.checkpoint`` under ``ctx`` for as long as the wrapping lasts, so the layers' recomputation
# in backward is stored compressed too (``NOTE [ Compressed recomputation ]``). Any other checkpointing
# function (offloading, selective checkpointing) is left as it is.
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
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        with ctx:
            return original(*args, **kwargs)

    forward.__daftrain_ctx__ = ctx  # type: ignore[attr-defined]
    module.forward = forward  # type: ignore[method-assign]
    swapped = _compress_recomputation(module, ctx)

    def undo() -> None:
        for layer, previous in swapped:
            layer._gradient_checkpointing_func = previous
        if had_instance_attr:
            module.forward = original  # type: ignore[method-assign]
        else:
            module.__dict__.pop("forward", None)

    return undo


def _compress_recomputation(module: nn.Module, ctx: compress) -> list[tuple[nn.Module, Any]]:
    """Swap plain ``torch.utils.checkpoint`` checkpointing functions of Hugging Face layers for the compressed
    one (``NOTE [ Compressing a module's forward ]``); returns each swapped layer with its previous function."""
    swapped: list[tuple[nn.Module, Any]] = []
    if ctx.config.bits is None:
        return swapped
    for layer in module.modules():
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if (isinstance(func, functools.partial) and func.func is torch.utils.checkpoint.checkpoint and not func.args
                and set(func.keywords) <= {"use_reentrant"}) or func is torch.utils.checkpoint.checkpoint:
            layer._gradient_checkpointing_func = functools.partial(compressed_checkpoint, compression=ctx)
            swapped.append((layer, func))
    return swapped
