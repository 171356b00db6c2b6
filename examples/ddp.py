"""DistributedDataParallel with compressed saved activations (gloo on CPU, NCCL on GPUs).

    python -m torch.distributed.run --nproc_per_node 2 examples/ddp.py --steps 5
    python -m torch.distributed.run --nproc_per_node 2 examples/ddp.py --budgeted --budget 2GB
    python -m torch.distributed.run --nproc_per_node 2 examples/ddp.py --budgeted --bits none \
        --budget +64MB,+64MB --budget-from 1:+64MB,+4MB --count-allreduce

Each rank trains on its shard of every batch; DDP averages the gradients, so every rank ends with the
same parameters as one process training on the whole batch. With ``--budgeted`` a ``BudgetedStep``
runs each step: the ranks agree on one plan, and micro-batches skip the gradient all-reduce until the
last one (``no_sync``). ``--budget`` takes one budget for every rank or one per rank
(comma-separated); ``+4MB`` means 4 MB above what the process holds when each step starts.
``--budget-from STEP:BUDGETS`` changes them from that step on. ``--count-allreduce`` counts DDP's
gradient all-reduces with a comm hook. ``--out`` saves rank 0's final parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import daftrain


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def batches(steps: int, batch: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def rank_budget(spec: str, rank: int) -> Callable[[], int | str]:
    """This rank's entry of a comma-separated budget list (one entry: every rank); ``+X`` is X above the
    process's resident memory when the budget is read (at the start of each step)."""
    entries = spec.split(",")
    entry = entries[rank] if len(entries) > 1 else entries[0]
    if entry.startswith("+"):
        extra = daftrain.Budget(entry[1:]).bytes()
        return lambda: resident_bytes() + extra
    return lambda: entry


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def say(line: str) -> None:
    """One line in one write, so the lines of two ranks sharing a terminal never interleave."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="the global batch, split over the ranks")
    ap.add_argument("--bits", default="2", help="1, 2, 4, 8 or none")
    ap.add_argument("--error-share", type=float, default=None,
                    help="compress with bits='auto' and this error_share instead of --bits")
    ap.add_argument("--budgeted", action="store_true", help="run each step through a BudgetedStep")
    ap.add_argument("--budget", default="4GB", help="one budget, or one per rank: '4GB' or '+64MB,+4MB'")
    ap.add_argument("--budget-from", default=None, help="STEP:BUDGETS, the budgets from that step on")
    ap.add_argument("--no-checkpoint", action="store_true", help="plans use micro-batches and bits only")
    ap.add_argument("--count-allreduce", action="store_true", help="count gradient all-reduces (comm hook)")
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--max-grad-norm", type=float, default=None, help="clip the gradients to this total norm")
    ap.add_argument("--out", help="save rank 0's final parameters here")
    args = ap.parse_args()
    bits = None if args.bits == "none" else int(args.bits)

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    model = make_model()
    allreduces = [0]
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
        if args.count_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
                allreduces[0] += 1
                return allreduce_hook(None, bucket)

            model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = args.batch_size // world

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    if args.budgeted:
        current = {"budget": rank_budget(args.budget, rank)}
        planner = daftrain.PlannerConfig(bits=(None,) if bits is None else (None, bits),
                                         checkpoint=not args.no_checkpoint)
        step = daftrain.BudgetedStep(model, loss_fn, optimizer, budget=lambda: current["budget"](), config=planner,
                                     compression=daftrain.CompressionConfig(bits=bits),
                                     max_grad_norm=args.max_grad_norm)
    ctx = (daftrain.compress(bits="auto", error_share=args.error_share, model=model) if args.error_share
           else daftrain.compress(bits=bits, model=model))
    for i, (x, y) in enumerate(batches(args.steps, args.batch_size, args.image_size)):
        local = (x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard])
        if args.budgeted:
            if args.budget_from and i == int(args.budget_from.split(":")[0]):
                current["budget"] = rank_budget(args.budget_from.split(":", 1)[1], rank)
            step(local)
            rec = step.history[-1]
            own = rec.rank_plan if rec.rank_plan is not None else rec.plan
            say(f"rank {rank}: step {i} own k={own.num_micro_batches} bits={own.bits} "
                f"ckpt={len(own.checkpointed)} | run k={rec.plan.num_micro_batches} bits={rec.plan.bits} "
                f"ckpt={','.join(rec.plan.checkpointed) or '-'} peak={rec.peak_bytes} budget={rec.budget_bytes}")
            continue
        with ctx:
            loss = loss_fn(model, local)
        loss.backward()
        if args.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if distributed:
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        say(f"rank {rank}: parameters identical on all {world} ranks: {same}")
        if args.budgeted:
            say(f"rank {rank}: plan {step.plan}")
        if args.count_allreduce:
            say(f"rank {rank}: gradient all-reduces {allreduces[0]} in {args.steps} steps")
        if args.error_share and ctx.report() is not None:
            say(f"rank {rank}: calibrated {ctx.report().gradient_sq is not None}, "
                f"error share {ctx.report().error_share}")
    if rank == 0 and args.out:
        torch.save(params, args.out)
    if distributed:
        dist.barrier()  # leave together: a rank tearing gloo down while the other still talks aborts
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    if "RANK" in os.environ:
        # NOTE [ Leaving without interpreter teardown ]: with the process group destroyed and every
        # output written, a rank can still abort in interpreter finalization ("terminate called without
        # an active exception": gloo's C++ threads against Python objects being torn down, a known
        # torch.distributed teardown race, seen here intermittently in CI). A launched rank
        # has nothing left to finalize, so it leaves directly.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
