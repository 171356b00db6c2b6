"""Bits by importance (``bits="auto"``): which op saved what (``tracing.py``), the estimated gradient
variance each tensor's quantization adds, the allocation of bits under a byte target (``allocation.py``),
the bit policies a ``compress`` context consults (``policy.py``), calibration, report and state."""

from .allocation import AllocationError
from .policy import Assignment, AutoBits, BitPolicy, FixedBits, make_bit_policy
from .report import AllocationReport
from .state import StateDictError
from .variance import QuantizationVarianceWarning

__all__ = ["AllocationError", "AllocationReport", "Assignment", "AutoBits", "BitPolicy", "FixedBits",
           "QuantizationVarianceWarning", "StateDictError", "make_bit_policy"]
