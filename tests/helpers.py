"""Shared test helpers."""

from __future__ import annotations

import math

import torch


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
