"""PyTorch Lightning: compressed saved activations with one callback.

Example::

    from daftrain.integrations.lightning import DaftrainCallback

    trainer = lightning.Trainer(max_epochs=1, callbacks=[DaftrainCallback(bits=2)])
    trainer.fit(module, datamodule)

The context is entered when a training batch starts and left just before its backward
(``on_before_backward``), so everything ``training_step`` saves for backward is compressed, whatever
modules it calls. Statistics of the latest step: ``callback.ctx.stats``.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback

from ..config import CompressionConfig
from ..saved import compress

__all__ = ["DaftrainCallback"]


class DaftrainCallback(Callback):
    """Runs each ``training_step`` under ``daftrain.compress(config, **fields)``."""

    def __init__(self, config: CompressionConfig | None = None, /, **fields: Any) -> None:
        self._config, self._fields = config, fields
        compress(config, **fields).close()  # validate the arguments now, not at fit time
        self.ctx: compress | None = None
        self._entered = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.ctx = compress(self._config, model=pl_module, **self._fields)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()
            self._entered = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._leave()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._leave()  # a step that returned no loss has no backward

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._leave()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._leave()
        if self.ctx is not None:
            self.ctx.close()

    def _leave(self) -> None:
        if self._entered and self.ctx is not None:
            self._entered = False
            self.ctx.__exit__(None, None, None)
