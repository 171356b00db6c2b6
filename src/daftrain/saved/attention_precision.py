"""How precisely an attention call's saves are stored: the error that rounding its q and k adds to its logits."""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable

import torch

from ..auto.allocation import NoiseProfile
from .per_position import PerPosition

__all__ = ["LOGIT_ERROR_LIMIT", "AttentionPrecision", "Precision", "logit_error"]

LOGIT_ERROR_LIMIT = 0.05
"""The rms logit error (in nats) above which an attention call's saves are kept exact, or its math path's copies
of q and k stored at 8 bits (``NOTE [ Attention logits that need more than 8 bits ]``)."""


# NOTE [ Attention logits that need more than 8 bits ]
# Fused attention's backward recomputes ``exp(scale * q k^T - logsumexp)`` from the saved q and k with
# the exact logsumexp (``NOTE [ Op rules ]``, 2.), so an error ``e`` in a logit is a factor ``exp(e)`` on
# its probability. Rounding q and k stochastically at ``b`` bits errs each logit by about
#     sqrt(scale**2 * d * (v_q * E[k**2] + v_k * E[q**2])),
# ``v`` the rounding noise's variance per value (a group's step squared over 6), ``d`` the head size:
# in proportion to the logits' own size. For most models at 8 bits that is a few thousandths of a nat,
# but logits of large spread (a model without the 1/sqrt(d) scale, a wide head, a large QK-norm gain)
# make it tenths, and a gradient far off at 8 bits (a text encoder of Hugging Face's with a 512-wide
# head and scale 1: docs/zoo.md). So the attention rule estimates that error for each call from its q
# and k and, where it is above ``LOGIT_ERROR_LIMIT``, keeps every tensor the call saves exact: q and k,
# and v and the output too. Logits of large spread make the probabilities peaked, and the backward's
# ``dS = P (dO v^T - rowsum(dO * out))`` is then a small remainder of two large terms, one read from v,
# one from the output, whose rounding errors do not cancel (keeping q and k alone exact left that text
# encoder far off at 4 bits). The limit, 0.05 nats (``exp(e)``'s mean off by ``e**2 / 2``, about 0.1 %),
# is where keeping them stops being cheap: a pretrained MiniLM's attention errs by a few hundredths of a
# nat at 8 bits, and keeping it exact grew its saved bytes by much for almost no gradient; apart from
# that text encoder, no architecture tried comes near the limit (docs/zoo.md has these measurements).
# SDPA's math path (which CPU takes with dropout or with a mask that requires grad) stores the probabilities
# P and backpropagates through ``q k^T`` as a product: ``dq = scale * dS k``, with rows of ``dS`` that sum
# to zero, so ``dq`` reads only the differences between k's rows, weighted by P. Peaked probabilities
# (logits of large spread again) leave a small remainder of k's rows there, while k's rounding noise does
# not cancel (dk likewise from q). The fused kernels never face this: they save q and k at 8 bits. So
# where rounding q and k at the bits the rest of the model gets would err the logits by more than the same
# limit, the copies the math path saves of q and k (``q * sqrt(scale)``, viewed for its matmul) are held
# at 8 bits too: a T5 (no 1/sqrt(d), a learned bias that requires grad) errs by ~0.2 nats at 4 bits, the
# other math-path models of the zoo by 0.011 at most (docs/zoo.md). Under bits="auto" the bits the rest
# gets are those fixed bits of the same bytes store (an ``avg_bits`` target: the same floors, so the same
# bytes), else the fewest the allocation may give a product's operand (2). P stays at the model's bits (it is
# ``n`` times q's size per head; at 8 bits it cost a pretrained encoder more bytes than plain 4 bits for a
# worse gradient), and attention written out as matmuls and a softmax is outside this rule (docs/zoo.md).
# The estimate reads values (a host sync on a GPU): it is made once per forward position and kept for
# ``REESTIMATE_STEPS`` steps, or until the call's shapes change (``PerPosition``). Its groups are runs of
# ``group_size`` values along q's rows in logical order, each row's range taken whole: where a row is
# longer than a group the estimate is high, never low.
def _noise(x: torch.Tensor, group_size: int) -> NoiseProfile:
    """The group ranges stochastic rounding of ``x`` in groups of ``group_size`` would have, per value (its
    ``energy(bits)`` is the mean variance per value that rounding adds at ``bits``)."""
    x = x.detach()
    lo, hi = x.amin(-1).reshape(-1).float(), x.amax(-1).reshape(-1).float()
    rows = max(1, group_size // max(1, x.shape[-1]))  # rows of x in one group
    pad = (-lo.numel()) % rows
    if pad:
        lo, hi = torch.cat([lo, lo[-1:].expand(pad)]), torch.cat([hi, hi[-1:].expand(pad)])
    ranges = hi.view(-1, rows).amax(1) - lo.view(-1, rows).amin(1)
    return NoiseProfile(plain_r2=float(ranges.double().square().mean()), zero_r2=0.0)


def _logit_errors(q: torch.Tensor, k: torch.Tensor, scale: float | None, bits: tuple[int, ...],
                  group_size: int) -> tuple[float, ...]:
    d = q.shape[-1]
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mean_sq = [float(t.detach().float().pow(2).mean()) for t in (q, k)]
    noise_q, noise_k = _noise(q, group_size), _noise(k, group_size)
    return tuple(math.sqrt(s * s * d * (noise_q.energy(b) * mean_sq[1] + noise_k.energy(b) * mean_sq[0]))
                 for b in bits)


def logit_error(q: torch.Tensor, k: torch.Tensor, scale: float | None, bits: int, group_size: int) -> float:
    """The rms error stochastic rounding of ``q`` and ``k`` at ``bits`` adds to ``scale * q k^T``
    (``NOTE [ Attention logits that need more than 8 bits ]``); ``scale`` None is SDPA's ``1/sqrt(d)``."""
    return _logit_errors(q, k, scale, (bits,), group_size)[0]


class Precision(enum.Enum):
    """How an attention call stores what it saves (``NOTE [ Attention logits that need more than 8 bits ]``)."""

    QK = "qk"
    """q and k as the call gets them at ``min_bits`` (what the fused kernels save), the rest plainly."""
    QK_AND_COPIES = "qk_and_copies"
    """So are the copies the call makes of q and k (the math path's scaled q and k)."""
    EXACT = "exact"
    """Everything the call saves is kept exact."""


class AttentionPrecision:
    """Per attention call of a forward (by its position), how precisely what it saves is stored, from the error
    that rounding its q and k would add to its logits at ``min_bits`` and at the ``bits`` the rest of the model
    gets (``NOTE [ Attention logits that need more than 8 bits ]``)."""

    def __init__(self, min_bits: int, bits: int, group_size: int, limit: float = LOGIT_ERROR_LIMIT) -> None:
        self.min_bits, self.bits, self.group_size, self.limit = min_bits, bits, group_size, limit
        self._made: PerPosition[Precision] = PerPosition()

    def of(self, step: int, index: int, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> Precision:
        """How the ``index``-th attention call of ``step``'s forward stores what it saves."""
        key: Hashable = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, scale)
        return self._made.get(step, index, key, lambda: self._precision(q, k, scale))

    def _precision(self, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> Precision:
        at_min_bits, at_bits = _logit_errors(q, k, scale, (self.min_bits, self.bits), self.group_size)
        if at_min_bits > self.limit:
            return Precision.EXACT
        return Precision.QK_AND_COPIES if at_bits > self.limit else Precision.QK
