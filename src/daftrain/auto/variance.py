"""The minibatch gradient's own variance, and the warning when quantization adds a large share of it."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from .report import AllocationReport

__all__ = ["GradProbe", "QuantizationVarianceWarning", "check_variance", "squared_norm"]


def squared_norm(t: torch.Tensor) -> float:
    """``||t||^2`` in double precision, of real and complex tensors alike."""
    t = t.detach()
    return float(torch.linalg.vector_norm(t, dtype=torch.complex128 if t.is_complex() else torch.float64)) ** 2


class QuantizationVarianceWarning(UserWarning):
    """The estimated quantization variance is a large share of the gradient's own variance."""


# NOTE [ Variance warning ]
# Given the model, the adaptation step and the step after it also record the parameter gradients;
# ``||g_t - g_{t+1}||^2 / 2`` estimates the minibatch gradient's variance (two independent draws of it,
# quantization noise included). When ``sum_i V_i(b_i)`` exceeds ``variance_warning`` times that, a
# ``QuantizationVarianceWarning`` says so (GACT warns at 0.1 the same way). One copy of the trainable
# parameters' gradients is held between those two steps.
class GradProbe:
    """Records the model's trainable gradients on two consecutive steps; see ``NOTE [ Variance warning ]``."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._first: dict[int, torch.Tensor] = {}
        self._diff_sq = 0.0
        self._phase = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self._phase == 0:
            self._first[id(p)] = p.grad.detach().clone()
        elif id(p) in self._first:
            first = self._first.pop(id(p))
            self._diff_sq += squared_norm(p.grad - first)

    def next_step(self) -> float | None:
        """Move to the second step; after it, return the variance estimate and stop listening."""
        self._phase += 1
        if self._phase == 1:
            return None
        self.remove()
        return self._diff_sq / 2

    def remove(self) -> None:
        """Stop listening and drop the recorded gradients."""
        for h in self._handles:
            h.remove()
        self._handles, self._first = [], {}


def check_variance(report: AllocationReport, grad_variance: float, threshold: float) -> AllocationReport:
    """``report`` with ``grad_variance`` filled in; warns when its quantization variance exceeds
    ``threshold`` times it (see ``NOTE [ Variance warning ]``)."""
    report = dataclasses.replace(report, grad_variance=grad_variance)
    if grad_variance > 0 and report.quant_variance > threshold * grad_variance:
        warnings.warn(
            f"daftrain: the estimated quantization variance ({report.quant_variance:.3e}) is "
            f"{report.quant_variance / grad_variance:.1%} of the minibatch gradient variance "
            f"({grad_variance:.3e}), above the {threshold:.0%} threshold; training may converge worse. "
            "Raise avg_bits (or packed_bytes), lower error_share, or lower the learning rate; ctx.report() lists "
            "the tensors.",
            QuantizationVarianceWarning, stacklevel=2,
        )
    return report
