"""DistributedDataParallel with compressed saved activations (gloo on CPU, NCCL on GPUs).

    python -m torch.distributed.run --nproc_per_node 2 examples/ddp.py --steps 5
    python -m torch.distributed.run --nproc_per_node 2 examples/ddp.py --budgeted --budget 2GB

Each rank trains on its shard of every batch; DDP averages the gradients, so every rank ends with the
same parameters as one process training on the whole batch. With ``--budgeted`` a ``BudgetedStep``
runs each step: the ranks agree on one plan, and micro-batches skip the gradient all-reduce until the
last one (``no_sync``). ``--out`` saves rank 0's final parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import daftrain


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="the global batch, split over the ranks")
    ap.add_argument("--bits", default="2", help="1, 2, 4, 8 or none")
    ap.add_argument("--budgeted", action="store_true", help="run each step through a BudgetedStep")
    ap.add_argument("--budget", default="4GB")
    ap.add_argument("--out", help="save rank 0's final parameters here")
    args = ap.parse_args()
    bits = None if args.bits == "none" else int(args.bits)

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    model = make_model()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = args.batch_size // world

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    if args.budgeted:
        step = daftrain.BudgetedStep(model, loss_fn, optimizer, budget=args.budget,
                                     compression=daftrain.CompressionConfig(bits=bits))
    ctx = daftrain.compress(bits=bits, model=model)
    for x, y in batches(args.steps, args.batch_size):
        local = (x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard])
        if args.budgeted:
            step(local)
            continue
        with ctx:
            loss = loss_fn(model, local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if distributed:
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        print(f"rank {rank}: parameters identical on all {world} ranks: {same}")
        if args.budgeted:
            print(f"rank {rank}: plan {step.plan}")
    if rank == 0 and args.out:
        torch.save(params, args.out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
