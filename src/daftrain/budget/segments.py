"""The model-side knobs of a budgeted step: checkpointable segments, checkpointing them for one
forward, in-place activations, and the BatchNorm remedy for micro-batching."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..saved.checkpoint import checkpoint as compressed_checkpoint
from ..saved.hooks import compress

__all__ = ["batchnorm_to_groupnorm", "checkpointing", "find_segments", "inplace_activations"]


def find_segments(model: nn.Module) -> dict[str, nn.Module]:
    """Checkpointable blocks: the children of every ``Sequential``/``ModuleList`` with two or more
    children, outermost first (ResNet ``layerN.i`` blocks, GPT-2 ``transformer.h.i``); the model's
    top-level children when there is none. Lone activations and dropouts are not blocks
    (``NOTE [ Elementwise modules are not segments ]``).
    """
    found: dict[str, nn.Module] = {}
    taken: list[str] = []
    for name, mod in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(mod, (nn.Sequential, nn.ModuleList)) and len(mod) >= 2:
            for child_name, child in mod.named_children():
                full = f"{name}.{child_name}" if name else child_name
                taken.append(full)
                if not _elementwise(child):
                    found[full] = child
    if not found:
        found = {n: c for n, c in model.named_children() if not _elementwise(c)}
    return found


# NOTE [ Elementwise modules are not segments ]
# Checkpointing a block keeps its input to recompute it. A lone activation or dropout module saves at
# most one tensor of its input's size, so checkpointing it saves nothing; and one that runs in place
# (``nn.LeakyReLU(inplace=True)``, or any of them under ``inplace_activations``) overwrites the very
# input the checkpoint kept, and the recomputation in backward fails on its version counter.
_ELEMENTWISE_MODULES = ("torch.nn.modules.activation", "torch.nn.modules.dropout")


def _elementwise(mod: nn.Module) -> bool:
    return type(mod).__module__ in _ELEMENTWISE_MODULES and not isinstance(mod, nn.MultiheadAttention)


# -- checkpointing -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Keep BatchNorm running statistics unchanged (the recomputation of a checkpointed block)."""
    saved = [(b, b.detach().clone()) for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
             for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


# NOTE [ Recomputation keeps BatchNorm statistics ]
# The recomputation in backward runs a checkpointed block a second time, in train mode; without
# freezing them, BatchNorm would update its running statistics twice per forward.
def _checkpointed_forward(module: nn.Module, original: Callable[..., Any],
                          compression: compress | None) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        calls = [0]

        def run(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return original(*a, **kw)
            with _frozen_running_stats(module):
                return original(*a, **kw)

        if compression is not None and compression.config.bits is not None:
            return compressed_checkpoint(run, *args, compression=compression, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return forward


@contextlib.contextmanager
def checkpointing(segments: Mapping[str, nn.Module], names: Sequence[str],
                  compression: compress | None = None) -> Iterator[None]:
    """Run the named segments under non-reentrant checkpoint inside the block; restore them after.

    Given the ``compress`` context the forward runs under (with bits), the recomputation in backward is
    stored compressed too (``daftrain.saved.checkpoint``); otherwise ``torch.utils.checkpoint`` runs them.

    The forward is replaced through an instance attribute only while the block runs (no permanent
    model rewrite); a pre-existing instance ``forward`` (e.g. from another wrapper) is put back.
    """
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name in names:
            mod = segments[name]
            previous = mod.__dict__.get("forward", None)
            mod.forward = _checkpointed_forward(mod, mod.forward, compression)  # type: ignore[method-assign]
            patched.append((mod, previous))
        yield
    finally:
        for mod, previous in reversed(patched):
            if previous is None:
                del mod.forward
            else:
                mod.forward = previous  # type: ignore[method-assign]


# -- in-place activations ----------------------------------------------------------------------------

_INPLACE_TYPES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.ELU, nn.CELU, nn.SELU, nn.Threshold)


def _inplace_pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
    x = args[0] if args else None
    # Only an intermediate activation may be overwritten: never a leaf, a user's input or a parameter.
    mod.inplace = isinstance(x, torch.Tensor) and x.grad_fn is not None and x._base is None


# NOTE [ In-place activations are exact ]
# An in-place ReLU writes its output over its input instead of allocating a new tensor, so one
# activation-sized buffer less is alive at each of them. Values and gradients are unchanged; where
# autograd needs the overwritten input it raises (version counter), and ``BudgetedStep`` verifies this
# once on an exact step before using it. A pre-hook applies it per call only to intermediate
# activations (never a leaf, a view, or a user's input).
@contextlib.contextmanager
def inplace_activations(model: nn.Module) -> Iterator[int]:
    """Run the model's out-of-place activation modules (ReLU, LeakyReLU, ELU, ...) in place
    (see NOTE [ In-place activations are exact ]).

    The modules' ``inplace`` flags are restored on exit. Yields the number of modules affected.
    """
    mods = [m for m in model.modules() if isinstance(m, _INPLACE_TYPES) and not m.inplace]
    handles = [m.register_forward_pre_hook(_inplace_pre_hook) for m in mods]
    try:
        yield len(mods)
    finally:
        for h in handles:
            h.remove()
        for m in mods:
            m.inplace = False


# -- BatchNorm remedy --------------------------------------------------------------------------------

def batchnorm_to_groupnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every ``BatchNorm2d`` by a ``GroupNorm`` (in place), so micro-batching changes nothing.

    GroupNorm normalises each sample on its own, so its results do not depend on how the batch is
    split. The groups are ``gcd(num_groups, channels)``. This changes the model (and the accuracy
    you get from it): it is the remedy to choose deliberately, before training starts.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            c = child.num_features
            gn = nn.GroupNorm(math.gcd(num_groups, c), c, eps=child.eps, affine=child.affine)
            if child.affine:
                with torch.no_grad():
                    gn.weight.copy_(child.weight)
                    gn.bias.copy_(child.bias)
            anchor = next(child.parameters(), torch.empty(0, dtype=torch.float32, device="cpu"))
            setattr(model, name, gn.to(anchor.device))
        else:
            batchnorm_to_groupnorm(child, num_groups)
    return model
