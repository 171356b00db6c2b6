"""A hand-written training loop with compressed saved activations.

    python examples/plain_loop.py --steps 20
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import daftrain
from daftrain.demo.data import image_dataset
from daftrain.demo.models import resnet18


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--bits", default="2", help="1, 2, 4, 8, auto or none")
    args = ap.parse_args()
    bits = None if args.bits == "none" else args.bits if args.bits == "auto" else int(args.bits)

    torch.manual_seed(0)
    data = image_dataset("train", size=32, channels=3, limit=args.steps * args.batch_size)
    model = resnet18(num_classes=data.num_classes, width=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = daftrain.compress(bits=bits, model=model)
    for step in range(args.steps):
        x = data.images[step * args.batch_size:(step + 1) * args.batch_size]
        y = data.labels[step * args.batch_size:(step + 1) * args.batch_size]
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    print(ctx.stats.summary())


if __name__ == "__main__":
    main()
