"""What ``bits="auto"`` knows of each saved tensor: its slot, its importance estimate, its bits, and the
report of the allocation in force (``compress.report()``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from .allocation import NoiseProfile

__all__ = ["AllocationReport", "SlotAllocation", "SlotEstimate", "SlotKey"]


# NOTE [ Slots ]
# A saved tensor is identified across steps by its *slot*: ``(index, numel, dtype)``, ``index`` being
# the position of its record among the records the forward pass creates (bool masks included;
# parameters, tensors kept exact and deduplicated saves create none). The same model running the same
# code path saves the same sequence, so slot ``i`` is the same layer's same saved tensor every step. A
# slot whose ``(numel, dtype)`` differs from the allocation's, or an index past its end, means the
# shapes changed: that tensor gets the fallback bits (``avg_bits`` rounded down to a supported width; 1
# with ``packed_bytes``) and the next step re-estimates. Except for another batch size under an
# ``avg_bits`` target, every slot's numel scaled by one ratio, whose allocation carries over (``NOTE
# [ Another batch size ]`` in policy.py): a ragged last batch costs no re-estimation there.
@dataclass(frozen=True, order=True)
class SlotKey:
    """A saved tensor's identity across steps; see ``NOTE [ Slots ]``."""

    index: int
    numel: int
    dtype: str

    @classmethod
    def of(cls, index: int, flat: torch.Tensor) -> SlotKey:
        """The slot of the record at forward position ``index`` holding ``flat``."""
        return cls(index, flat.numel(), str(flat.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class SlotEstimate:
    """What an adaptation step measured of one slot: the input of the allocation."""

    key: SlotKey
    shape: tuple[int, ...]
    itemsize: int
    op: str
    """The torch function(s) that saved the tensor on the adaptation step, ``+``-joined (``""`` if none)."""
    producer: str
    """The autograd node that produced the tensor (views skipped; ``""`` for none)."""
    grad_sq: float | None
    """``||G||^2`` of the saving ops' output gradients on the adaptation step; ``None`` when none arrived."""
    noise: NoiseProfile
    sensitivity: float
    """The analytic estimate; see ``NOTE [ Importance estimate ]`` in ``tracing.py``."""
    min_bits: int
    """The fewest bits it may get; see ``NOTE [ Fewest bits ]`` in ``tracing.py``."""

    @property
    def slot_class(self) -> str:
        """Slots of one class share a calibration: same saving op(s), producer and size."""
        return f"{self.op}|{self.producer}|{self.key.numel}"


@dataclass(frozen=True)
class SlotAllocation(SlotEstimate):
    """One slot's importance estimate and its allocated bits (``None`` = kept exact)."""

    calibration: float
    """The measured correction of its class (1.0 until ``calibrate``); see ``NOTE [ Calibration ]``."""
    bits: int | None
    nbytes: int
    variance: float
    """Estimated gradient variance the slot adds at ``bits`` (``sensitivity * calibration * noise.energy(bits)``)."""


@dataclass(frozen=True)
class AllocationReport:
    """The allocation in force: per slot importance and bits, and the budget; ``str()`` is a table."""

    estimated_at_step: int
    next_adapt_step: int
    target_bytes: int
    used_bytes: int
    slots: tuple[SlotAllocation, ...]
    quant_variance: float
    grad_variance: float | None
    """Minibatch gradient variance measured around the last adaptation (needs ``model``)."""
    gradient_sq: float | None = None
    """The gradient's squared norm measured by the last ``calibrate`` (``None`` before one); the bound of
    ``error_share`` is a share of it."""

    @property
    def avg_bits(self) -> float:
        """Stored bits per value over the allocated slots, per-group overhead included."""
        numel = sum(s.key.numel for s in self.slots)
        return 8 * self.used_bytes / numel if numel else 0.0

    @property
    def variance_share(self) -> float | None:
        """``quant_variance / grad_variance`` (``None`` without a measured gradient variance)."""
        if self.grad_variance is None or self.grad_variance <= 0:
            return None
        return self.quant_variance / self.grad_variance

    @property
    def error_share(self) -> float | None:
        """``quant_variance / gradient_sq``: the estimated share of the gradient's squared norm that
        quantization adds (``None`` before ``calibrate``)."""
        if self.gradient_sq is None or self.gradient_sq <= 0:
            return None
        return self.quant_variance / self.gradient_sq

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values, one entry per slot."""
        return {
            "estimated_at_step": self.estimated_at_step, "next_adapt_step": self.next_adapt_step,
            "target_bytes": self.target_bytes, "used_bytes": self.used_bytes, "avg_bits": self.avg_bits,
            "quant_variance": self.quant_variance, "grad_variance": self.grad_variance,
            "variance_share": self.variance_share, "gradient_sq": self.gradient_sq, "error_share": self.error_share,
            "slots": [
                {"index": s.key.index, "shape": list(s.shape), "dtype": s.key.dtype, "numel": s.key.numel,
                 "op": s.op, "producer": s.producer, "min_bits": s.min_bits, "bits": s.bits, "nbytes": s.nbytes,
                 "sensitivity": s.sensitivity, "calibration": s.calibration, "variance": s.variance}
                for s in self.slots
            ],
        }

    def to_json(self) -> str:
        """``to_dict()`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """One line per slot, then a summary line."""
        lines = [f"{'slot':>5} {'shape':<22} {'dtype':<9} {'saved by':<24} {'sensitivity':>11} {'calib.':>9} "
                 f"{'bits':>5} {'bytes':>11} {'est. var':>10}"]
        for s in self.slots:
            bits = "exact" if s.bits is None else str(s.bits)
            lines.append(f"{s.key.index:>5} {'x'.join(map(str, s.shape)):<22} {s.key.dtype:<9} {s.op[:24]:<24} "
                         f"{s.sensitivity:>11.3e} {s.calibration:>9.3g} {bits:>5} {s.nbytes:>11,} "
                         f"{s.variance:>10.3e}")
        share = self.variance_share
        lines.append(
            f"{len(self.slots)} slots, {self.used_bytes:,} of {self.target_bytes:,} target bytes "
            f"({self.avg_bits:.2f} bits/value); est. quantization variance {self.quant_variance:.3e}"
            + (f", {share:.1%} of the gradient variance" if share is not None else "")
            + (f", {self.error_share:.2%} of the gradient's squared norm" if self.error_share is not None else "")
            + f"; estimated at step {self.estimated_at_step}, next at {self.next_adapt_step}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
