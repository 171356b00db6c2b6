"""Shared test helpers."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio ``20 log10(|ref| / |ref - approx|)`` in dB (inf when equal)."""
    ref, approx = ref.double().flatten(), approx.double().flatten()
    noise = torch.linalg.vector_norm(ref - approx).item()
    if noise == 0:
        return math.inf
    return 20 * math.log10(torch.linalg.vector_norm(ref).item() / noise)


def grads_of(module: torch.nn.Module, *extra: torch.Tensor) -> torch.Tensor:
    """All parameter gradients of ``module`` (and of ``extra`` tensors) as one flat vector."""
    parts = [p.grad.flatten() for p in module.parameters() if p.grad is not None]
    parts += [t.grad.flatten() for t in extra]
    return torch.cat(parts)


def saving_probe(seen: list[tuple[torch.Tensor, ...]]) -> type[torch.autograd.Function]:
    """An autograd Function that saves its inputs for backward and, in backward, appends what it gets
    back (``ctx.saved_tensors``, restored through whatever saved-tensor hooks were active) to ``seen``. ``compress``
    keeps a custom Function's float saves exact unless ``quantize_custom_functions=True``, which tests that probe
    how saves are stored pass."""

    class SavingProbe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            ctx.save_for_backward(*inputs)
            return sum(x.sum() for x in inputs)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
            seen.append(ctx.saved_tensors)
            return (None,) * len(ctx.saved_tensors)

    return SavingProbe


@contextlib.contextmanager
def statistics_not_stored() -> Iterator[list[int]]:
    """While active, the bytes of the float32 mean and std that each normalisation input quantized as it is
    did not store (``NOTE [ Normalising only where groups straddle statistics ]``) are appended to the list
    it yields: what a layout that normalises the same tensor stores more."""
    from daftrain.saved import records

    skipped: list[int] = []
    candidate = records.Normalized.candidate

    def spy(self, flat, bits, group_size, seed, grids=None):  # type: ignore[no-untyped-def]
        if self.groups_within_rows(group_size):
            rows = math.prod(size for dim, size in enumerate(self.view) if dim not in self.reduce)
            skipped.append(rows * 4 * (2 if self.center else 1))
        return candidate(self, flat, bits, group_size, seed, grids)

    records.Normalized.candidate = spy
    try:
        yield skipped
    finally:
        records.Normalized.candidate = candidate


class CreatedTensors(TorchDispatchMode):
    """While active, the number of values of each tensor an op returns that shares no storage with the op's
    tensor arguments (in-place ops and views of inputs are not counted), in ``numels``."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                  if isinstance(a, torch.Tensor)}
        self.numels += [o.numel() for o in (out if isinstance(out, (tuple, list)) else (out,))
                        if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs]
        return out
