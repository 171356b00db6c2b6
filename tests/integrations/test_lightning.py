"""The Lightning integration: a real ``Trainer.fit`` of a small CNN on Fashion-MNIST, against the same fit
without daftrain."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn

from daftrain.demo.data import image_dataset
from daftrain.integrations.lightning import DaftrainCallback


class _Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.GELU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(callbacks, steps=4):
    data = image_dataset("train", size=28, channels=1, limit=64 * steps)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.images, data.labels), batch_size=64)
    pl.seed_everything(0, verbose=False)
    module = _Classifier()
    initial = torch.cat([p.detach().flatten() for p in module.parameters()])
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, loader)
    return torch.cat([p.detach().flatten() for p in module.parameters()]) - initial


def test_exact_mode_fits_bit_identically_to_plain():
    plain = _fit([])
    callback = DaftrainCallback(bits=None)
    ours = _fit([callback])
    assert torch.equal(ours, plain)
    assert callback.ctx.stats.tensors_seen > 0


def test_compressed_fit_tracks_plain_and_saves_bytes():
    plain = _fit([])
    callback = DaftrainCallback(bits=8)
    ours = _fit([callback])
    stats = callback.ctx.stats
    assert stats.compressed > 0 and stats.ratio > 2.0, stats.summary()
    # SGD updates are linear in the gradients; 8-bit activations keep them within cosine 0.999.
    assert torch.nn.functional.cosine_similarity(ours, plain, dim=0) >= 0.999
