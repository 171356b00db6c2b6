"""FSDP2 (``fully_shard``) with compressed saved activations, on CPU with gloo (or GPUs with NCCL).

    python -m torch.distributed.run --nproc_per_node 2 examples/fsdp.py --steps 3 --bits 2

Every linear layer and the whole model are sharded over the ranks (``--wrap root``: the model as one unit);
each forward all-gathers a layer's weights just before it runs. ``compress`` stores the activations autograd
saves quantized; the all-gathered (unsharded) weights are parameters, kept as they are (``stats.parameters``
counts them). The model returns its loss, as Hugging Face's models do. Each rank trains on its shard of every
batch; FSDP reduce-scatters the averaged gradients, so the result equals one process training on the whole
batch. ``--out`` saves the full parameters (rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import daftrain


class WithLoss(nn.Module):
    """A network that returns its loss given the labels, as Hugging Face's models do."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, classes))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


def batches(steps: int, batch: int, classes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 64, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def full_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded ``DTensor`` is gathered), flattened into one tensor."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                      for p in model.parameters()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the ranks")
    ap.add_argument("--bits", default="2", help="1, 2, 4, 8 or none")
    ap.add_argument("--classes", type=int, default=10,
                    help="the head's outputs (more than 1024 make it a wide layer, as a language model's head is)")
    ap.add_argument("--wrap", choices=("layers", "root"), default="layers",
                    help="shard every linear layer and the model (layers), or only the model as one unit (root)")
    ap.add_argument("--out", help="save the final parameters here (rank 0)")
    args = ap.parse_args()
    bits = None if args.bits == "none" else int(args.bits)

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    model = WithLoss(args.classes)
    if distributed:
        from torch.distributed.fsdp import fully_shard

        for layer in model.net if args.wrap == "layers" else ():
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = args.batch_size // world
    ctx = daftrain.compress(bits=bits, model=model)
    for x, y in batches(args.steps, args.batch_size, args.classes):
        local = (x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard])
        with ctx:
            loss = model(*local)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    s = ctx.stats
    print(f"rank {rank}: saved tensors {s.tensors_seen}: {s.compressed} quantized, {s.parameters} parameters, "
          f"{s.kept} kept exact; loss node {type(loss.grad_fn).__name__}", flush=True)
    params = full_parameters(model)
    if distributed:
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        print(f"rank {rank}: parameters identical on all {world} ranks: "
              f"{all(torch.equal(g, gathered[0]) for g in gathered)}")
    if rank == 0 and args.out:
        torch.save(params, args.out)
    if distributed:
        dist.barrier()  # leave together: a rank tearing gloo down while the other still talks aborts
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if "RANK" in os.environ:  # NOTE [ Leaving without interpreter teardown ] in examples/ddp.py
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
