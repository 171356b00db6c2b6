"""``torch.compile`` with compressed saved activations: the hooks are inlined into the compiled graphs.

    python examples/compile.py --steps 20 [--backend inductor]

A compiled graph runs with the hooks disabled; what it stores is decided when it is compiled and shown in
``ctx.stats`` (``compiled_*``). Fixed bits only: ``bits="auto"``, a ``PagePool`` or asynchronous packing
leave compiled graphs exact and say so with one ``CompileFallbackWarning``.
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
    ap.add_argument("--bits", type=int, default=2, choices=[1, 2, 4, 8])
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    args = ap.parse_args()

    torch.manual_seed(0)
    data = image_dataset("train", size=32, channels=3, limit=args.steps * args.batch_size)
    model = resnet18(num_classes=data.num_classes, width=16)
    compiled = torch.compile(model, backend=args.backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = daftrain.compress(bits=args.bits, model=model)
    for step in range(args.steps):
        x = data.images[step * args.batch_size:(step + 1) * args.batch_size]
        y = data.labels[step * args.batch_size:(step + 1) * args.batch_size]
        with ctx:
            loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    stats = ctx.stats
    print(f"compiled graphs: {stats.compiled_graphs}; {stats.compiled_quantized} of {stats.compiled_saved} saved "
          f"tensors quantized, {stats.compiled_bool_packed} bool-packed; {stats.compiled_raw_bytes / 1e6:.2f} MB -> "
          f"{stats.compiled_stored_bytes / 1e6:.2f} MB per step")


if __name__ == "__main__":
    main()
