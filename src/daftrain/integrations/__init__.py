"""Integrations with training frameworks: ``daftrain.integrations.transformers`` (Hugging Face
``Trainer``) and ``daftrain.integrations.lightning`` (PyTorch Lightning). Each imports its framework only
when used."""

from .forward import compress_forward

__all__ = ["compress_forward"]
