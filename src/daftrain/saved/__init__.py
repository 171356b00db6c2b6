"""The saved-tensor pipeline: ``compress`` decides what each tensor autograd saves gets, packs it into a
record (in memory or in pool pages) and restores it in backward."""

from ..errors import InPlaceModificationError
from .checkpoint import RecomputationMismatchError, checkpoint
from .compiled import CompileFallbackWarning
from .hooks import compress
from .nesting import CustomFunctionWarning
from .op_rules import AmplifiedRoundingWarning
from .stats import CompressionStats

__all__ = ["AmplifiedRoundingWarning", "CompileFallbackWarning", "CompressionStats", "CustomFunctionWarning",
           "InPlaceModificationError", "RecomputationMismatchError", "checkpoint", "compress"]
