"""Whether fused attention's q and k may be stored at 8 bits: the error that rounding them adds to its logits."""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from ..auto.allocation import NoiseProfile
from .per_position import PerPosition

__all__ = ["LOGIT_ERROR_LIMIT", "AttentionPrecision", "logit_error"]

LOGIT_ERROR_LIMIT = 0.05
"""The rms logit error (in nats) above which an attention call's saves are kept exact (``NOTE [ Attention
logits that need more than 8 bits ]``)."""


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
# The estimate reads values (a host sync on a GPU): it is made once per forward position and kept for
# ``REESTIMATE_STEPS`` steps, or until the call's shapes change (``PerPosition``). Its groups are runs of
# ``group_size`` values along q's rows in logical order, each row's range taken whole: where a row is
# longer than a group the estimate is high, never low.
def _noise_variance(x: torch.Tensor, bits: int, group_size: int) -> float:
    """Mean variance per value that stochastic rounding at ``bits`` adds to ``x`` in groups of ``group_size``
    (``NoiseProfile``'s analytic energy of those groups, per value)."""
    x = x.detach()
    lo, hi = x.amin(-1).reshape(-1).float(), x.amax(-1).reshape(-1).float()
    rows = max(1, group_size // max(1, x.shape[-1]))  # rows of x in one group
    pad = (-lo.numel()) % rows
    if pad:
        lo, hi = torch.cat([lo, lo[-1:].expand(pad)]), torch.cat([hi, hi[-1:].expand(pad)])
    ranges = hi.view(-1, rows).amax(1) - lo.view(-1, rows).amin(1)
    return NoiseProfile(plain_r2=float(ranges.double().square().mean()), zero_r2=0.0).energy(bits)


def logit_error(q: torch.Tensor, k: torch.Tensor, scale: float | None, bits: int, group_size: int) -> float:
    """The rms error stochastic rounding of ``q`` and ``k`` at ``bits`` adds to ``scale * q k^T``
    (``NOTE [ Attention logits that need more than 8 bits ]``); ``scale`` None is SDPA's ``1/sqrt(d)``."""
    d = q.shape[-1]
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mean_sq = [float(t.detach().float().pow(2).mean()) for t in (q, k)]
    variance = s * s * d * (_noise_variance(q, bits, group_size) * mean_sq[1]
                            + _noise_variance(k, bits, group_size) * mean_sq[0])
    return math.sqrt(variance)


class AttentionPrecision:
    """Per attention call of a forward (by its position), whether rounding its q and k at ``bits`` would err
    its logits by more than ``limit``, so that what it saves is kept exact (``NOTE [ Attention logits that
    need more than 8 bits ]``)."""

    def __init__(self, bits: int, group_size: int, limit: float = LOGIT_ERROR_LIMIT) -> None:
        self.bits, self.group_size, self.limit = bits, group_size, limit
        self._exact: PerPosition[bool] = PerPosition()

    def keep_exact(self, step: int, index: int, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> bool:
        """Whether the ``index``-th attention call of ``step``'s forward keeps what it saves exact."""
        key: Hashable = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, scale)
        return self._exact.get(step, index, key,
                               lambda: logit_error(q, k, scale, self.bits, self.group_size) > self.limit)
