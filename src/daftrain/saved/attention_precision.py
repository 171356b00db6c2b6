"""How precisely an attention call's saves are stored: the error that rounding its q and k adds to its logits."""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable

import torch

from ..auto.allocation import NoiseProfile
from .per_position import PerPosition

__all__ = ["FEWEST_BITS", "LOGIT_ERROR_LIMIT", "AttentionPrecision", "MaskStorage", "logit_error", "mask_error"]

FEWEST_BITS = 2
"""The fewest bits a saved tensor with no floor may get under fixed bits (``bits="auto"`` may give 1)."""
LOGIT_ERROR_LIMIT = 0.05
"""The rms logit error (in nats) at ``ATTENTION_MIN_BITS`` above which an attention call's saves are kept exact
(``NOTE [ Attention logits that need more than 8 bits ]``)."""


# NOTE [ Attention logits that need more than 8 bits ]
# Attention's backward recomputes ``exp(scale * q k^T - logsumexp)`` from the saved q and k, so an error
# ``e`` in a logit is an error ``e`` in the log of its probability (``NOTE [ Op rules ]``, 2.). Rounding q and
# k stochastically at ``b`` bits errs each logit by about
#     sqrt(scale**2 * d * (v_q * E[k**2] + v_k * E[q**2])),
# ``v`` the rounding noise's variance per value (a group's step squared over 6), ``d`` the head size:
# in proportion to the logits' own size. For most models at 8 bits that is a few thousandths of a nat,
# but logits of large spread (a model without the 1/sqrt(d) scale, a wide head, a large QK-norm gain)
# make it tenths, and a gradient far off at 8 bits (a text encoder of Hugging Face's with a 512-wide
# head and scale 1: docs/zoo.md). So the attention rule estimates that error for each call from its q
# and k and, where it is above ``LOGIT_ERROR_LIMIT``, keeps every tensor the call saves exact (q, k and v:
# logits of large spread make the probabilities peaked, and the backward's ``dS = P (dP - rowsum(P dP))``
# a small remainder of terms read from v). The limit, 0.05 nats (a factor ``exp(e)`` off by about 5 % on
# a probability), is where keeping them stops being cheap: a pretrained MiniLM's attention errs by a few
# hundredths of a nat at 8 bits, and keeping it exact grew its saved bytes by much for little gradient;
# apart from that text encoder, no architecture of the zoo comes near the limit (docs/zoo.md has these
# measurements). An additive float mask that requires grad (a learned position bias) is an input of the
# recomputed call too (``NOTE [ Attention recomputed from its stored inputs ]`` in
# ``recomputed_attention.py``), and its rounding errs the logits by itself: it is stored as any saved tensor
# where even ``FEWEST_BITS`` would err them by at most the limit, at ``min_bits`` where those would, else as
# it is (a floor such as ``finfo.min`` added into it gives a group a range of ~1e38); any other mask is kept
# as it is. The estimates read values (a host sync on a GPU): each is made once per forward position and
# kept for ``REESTIMATE_STEPS`` steps, or until the call's shapes change (``PerPosition``). Their groups
# are runs of ``group_size`` values along q's rows in logical order, each row's range taken whole: where a
# row is longer than a group the estimate is high, never low.
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


def logit_error(q: torch.Tensor, k: torch.Tensor, scale: float | None, bits: int, group_size: int) -> float:
    """The rms error stochastic rounding of ``q`` and ``k`` at ``bits`` adds to ``scale * q k^T``
    (``NOTE [ Attention logits that need more than 8 bits ]``); ``scale`` None is SDPA's ``1/sqrt(d)``."""
    d = q.shape[-1]
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mean_sq = [float(t.detach().float().pow(2).mean()) for t in (q, k)]
    noise_q, noise_k = _noise(q, group_size), _noise(k, group_size)
    return math.sqrt(s * s * d * (noise_q.energy(bits) * mean_sq[1] + noise_k.energy(bits) * mean_sq[0]))


def mask_error(mask: torch.Tensor, bits: int, group_size: int) -> float:
    """The rms error stochastic rounding of an additive attention mask at ``bits`` adds to the logits (infinite
    where the mask holds a floor such as ``finfo.min`` next to ordinary values, NaN where it holds a NaN)."""
    return math.sqrt(_noise(mask, group_size).energy(bits))


class MaskStorage(enum.Enum):
    """How an attention call's learned float mask is stored (``AttentionPrecision.mask_storage``)."""

    ROUNDED = "rounded"
    """As any saved tensor, at the bits it gets."""
    AT_MIN_BITS = "at_min_bits"
    """At ``min_bits`` at least, like q and k."""
    EXACT = "exact"
    """As it is."""


class AttentionPrecision:
    """Per attention call of a forward (by its position), whether what it saves is kept exact: where rounding
    its q and k at ``min_bits`` would err its logits by more than ``limit`` (``NOTE [ Attention logits that
    need more than 8 bits ]``)."""

    def __init__(self, min_bits: int, group_size: int, limit: float = LOGIT_ERROR_LIMIT) -> None:
        self.min_bits, self.group_size, self.limit = min_bits, group_size, limit
        self._made: PerPosition[bool] = PerPosition()
        self._masks: PerPosition[MaskStorage] = PerPosition()

    def exact(self, step: int, index: int, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> bool:
        """Whether the ``index``-th attention call of ``step``'s forward keeps what it saves exact."""
        key: Hashable = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, scale)
        return self._made.get(step, index, key,
                              lambda: logit_error(q, k, scale, self.min_bits, self.group_size) > self.limit)

    def mask_storage(self, step: int, index: int, mask: torch.Tensor) -> MaskStorage:
        """How the ``index``-th attention call of ``step``'s forward stores its float mask (a learned bias): as any
        saved tensor where even 2 bits would err the logits by at most ``limit``, else at ``min_bits`` where
        those would, else as it is (``NOTE [ Attention logits that need more than 8 bits ]``)."""
        key: Hashable = ("mask", tuple(mask.shape), mask.dtype, mask.device)
        return self._masks.get(step, index, key, lambda: self._mask_storage(mask))

    def _mask_storage(self, mask: torch.Tensor) -> MaskStorage:
        if mask_error(mask, FEWEST_BITS, self.group_size) <= self.limit:
            return MaskStorage.ROUNDED
        if mask_error(mask, self.min_bits, self.group_size) <= self.limit:
            return MaskStorage.AT_MIN_BITS
        return MaskStorage.EXACT  # a floor such as finfo.min next to ordinary values, or a NaN
