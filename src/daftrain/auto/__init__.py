"""Bits by importance (``bits="auto"``): which op saved what, the estimated gradient variance each
tensor's quantization adds, the allocation of bits under a byte target, calibration, report and state."""

from .allocation import AllocationError
from .importance import AllocationReport, AutoBits, QuantizationVarianceWarning, StateDictError

__all__ = ["AllocationError", "AllocationReport", "AutoBits", "QuantizationVarianceWarning", "StateDictError"]
