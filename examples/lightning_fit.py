"""PyTorch Lightning with compressed saved activations: one callback.

    python examples/lightning_fit.py --steps 20
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch
from torch import nn

from daftrain.demo.data import image_dataset
from daftrain.demo.models import resnet18
from daftrain.integrations.lightning import DaftrainCallback


class Classifier(pl.LightningModule):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = resnet18(num_classes=num_classes, width=16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--bits", type=int, default=2)
    args = ap.parse_args()
    pl.seed_everything(0, verbose=False)
    data = image_dataset("train", size=32, channels=3, limit=args.steps * args.batch_size)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.images, data.labels),
                                         batch_size=args.batch_size)
    callback = DaftrainCallback(bits=args.bits)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(Classifier(data.num_classes), loader)
    print(callback.ctx.stats.summary())


if __name__ == "__main__":
    main()
