"""Hugging Face ``Trainer``: compressed saved activations with one line.

Example::

    from daftrain.integrations.transformers import DaftrainCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[DaftrainCallback(bits=2)])
    trainer.train()

Works with ``peft`` adapters (frozen base weights are parameters and stay exact) and with
``gradient_checkpointing`` (the layers' recomputation in backward is stored compressed too, through
``daftrain.checkpoint``) and with ``torch_compile`` (the hooks are inlined into the compiled graphs: fixed bits
only, see ``compress``). Statistics of the latest step: ``callback.ctx.stats``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ..config import CompressionConfig
from ..saved import compress
from .forward import compress_forward

__all__ = ["DaftrainCallback"]


class DaftrainCallback(TrainerCallback):
    """Runs every training forward of the trainer's model under ``daftrain.compress(config, **fields)``."""

    def __init__(self, config: CompressionConfig | None = None, /, **fields: Any) -> None:
        self._config, self._fields = config, fields
        compress(config, **fields).close()  # validate the arguments now, not at train time
        self.ctx: compress | None = None
        self._undo: Callable[[], None] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.ctx = compress(self._config, model=model, **self._fields)
        self._undo = compress_forward(model, self.ctx)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        if self.ctx is not None:
            self.ctx.close()
