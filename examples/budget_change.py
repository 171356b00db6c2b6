"""Training while another process takes memory away and gives it back: the plan follows the system.

    python examples/budget_change.py            # CIFAR-style ResNet-18, batch 128: a few minutes on 2 cores
    python examples/budget_change.py --quick    # a narrow ResNet-18: well under a minute

The step's budget is ``daftrain.Budget.system(0.9)``, read from the system before every step. Where this
process may create a memory cgroup (root, with the cgroup v1 memory hierarchy or a cgroup v2 tree whose
memory controller is delegated to its cgroup), it creates one under its own, joins it and starts a
second process there, the memory hog; the cgroup gets a limit that leaves ``--room`` above what the
trainer holds after a plain warm-up step. The budget is then the room under that limit, which the kernel
enforces: a step over it would be OOM-killed. Without a cgroup (``--cgroup off``, or no permission) the
budget follows ``MemAvailable`` with a ``reserve`` that leaves the same room; other processes on the
machine then move it too.

At step ``--take-at`` the trainer tells the hog, through a pipe (so the schedule is counted in steps,
not wall time), to allocate and touch ``--hog`` bytes; at ``--free-at`` to free them. ``--room`` and
``--hog`` are multiples of the plain step's measured activation memory, so the same schedule fits any
model: with the defaults the plain step fits before and after the hog and not while it holds its
memory. Every step records its budget, measured peak, RSS, the plan and the step time; the run writes
them to ``--out`` (JSON, and a PNG beside it where matplotlib is installed) and exits with status 1 if
any step's peak went over its budget.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import daftrain
from daftrain.allocator import tighten_allocator
from daftrain.budget.budgets import read_system_memory
from daftrain.budget.memory import meter_for
from daftrain.demo.data import image_dataset
from daftrain.demo.models import resnet18
from daftrain.rss import current_rss_bytes

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "budget_change.json"
FRACTION = 0.9

# The hog: a plain Python process (no torch), so it holds only what it is told to.
HOG = r"""
import sys
held = None
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "take":
        n = int(cmd[1])
        held = bytearray(n)
        held[::4096] = b"\1" * len(range(0, n, 4096))  # touch every page: resident, charged to the cgroup
    elif cmd[0] == "free":
        held = None
    print("done", flush=True)
"""

_NOT_PERMITTED = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR)


# -- the cgroup --------------------------------------------------------------------------------------

class MemoryCgroup:
    """A memory cgroup created under this process's own (v1 or v2), which this process joins."""

    def __init__(self, parent: Path, version: int) -> None:
        self.parent, self.version = parent, version
        self.path = parent / f"daftrain-budget-change-{os.getpid()}"
        self.path.mkdir()
        names = {1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes"),
                 2: ("memory.max", "memory.current", "memory.peak")}[version]
        self.limit_file, self.usage_file, self.peak_file = (self.path / n for n in names)
        self.run_peak = 0  # the peak across resets

    @classmethod
    def enter(cls) -> tuple[MemoryCgroup | None, str]:
        """Create the cgroup and move this process into it: from then on what it allocates is charged
        there. ``None`` and why not where that is not permitted."""
        why = "no memory cgroup hierarchy found"
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                parent, version = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), 1
            elif hid == "0" and controllers == "":
                base = next((b for b in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
                             if (b / "cgroup.controllers").is_file()), None)
                if base is None:
                    continue
                parent, version = base / path.lstrip("/"), 2
                with contextlib.suppress(OSError):
                    if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                        why = f"cgroup v2 {parent} does not delegate the memory controller to its children"
                        continue
            else:
                continue
            try:
                cgroup = cls(parent, version)
            except OSError as exc:
                if exc.errno not in _NOT_PERMITTED:
                    raise
                why = f"cannot create a cgroup under {parent}: {exc.strerror}"
                continue
            try:
                (cgroup.path / "cgroup.procs").write_text(str(os.getpid()))
            except OSError as exc:
                cgroup.path.rmdir()
                if exc.errno not in (*_NOT_PERMITTED, errno.EBUSY):
                    raise
                why = f"cannot move this process into {cgroup.path}: {exc.strerror}"
                continue
            return cgroup, f"cgroup v{version}"
        return None, why

    def usage(self) -> int:
        return int(self.usage_file.read_text())

    def set_limit(self, limit: int) -> None:
        self.limit_file.write_text(str(limit))

    def reset_peak(self) -> bool:
        """Reset the peak usage where the kernel allows it (v1; v2's ``memory.peak`` resets only per open
        file), so that ``peak_usage`` then reads one step's peak."""
        if self.version != 1:
            return False
        self.peak_usage()
        self.peak_file.write_text("0")
        return True

    def peak_usage(self) -> int:
        """Peak usage since the last reset (-1 where the kernel does not say)."""
        peak = int(self.peak_file.read_text()) if self.peak_file.exists() else -1
        self.run_peak = max(self.run_peak, peak)
        return peak

    def events(self) -> dict[str, int]:
        """Peak usage over the run, how often the limit was hit, OOM kills."""
        self.peak_usage()
        out = {"peak_usage": self.run_peak if self.run_peak > 0 else -1}
        if self.version == 1:
            out["limit_hits"] = int((self.path / "memory.failcnt").read_text())
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
        else:
            ev = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            out["limit_hits"], out["oom_kills"] = int(ev.get("max", 0)), int(ev.get("oom_kill", 0))
        return out

    def remove(self) -> None:
        """Leave the cgroup (back to the parent) and remove it; its charges go to the parent."""
        (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.1)
        self.path.rmdir()


@contextlib.contextmanager
def hog_process() -> Iterator[subprocess.Popen[str]]:
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield hog
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(timeout=30)


def tell(hog: subprocess.Popen[str], command: str) -> None:
    """Send ``command`` to the hog and wait until it has done it."""
    assert hog.stdin is not None and hog.stdout is not None
    hog.stdin.write(command + "\n")
    hog.stdin.flush()
    if hog.stdout.readline().strip() != "done":
        raise RuntimeError(f"the memory hog did not confirm {command!r} (exit status {hog.poll()})")


# -- training ----------------------------------------------------------------------------------------

def plain_activation_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                           y: torch.Tensor) -> int:
    """One plain step on the whole batch; returns the peak RSS of its forward and backward above the
    RSS before it (the step also creates the optimizer's state, as training would)."""
    meter = meter_for(torch.device("cpu"))
    start = meter.start()
    nn.functional.cross_entropy(model(x), y).backward()
    peak = meter.peak()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return peak - start


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    x = [s["step"] for s in steps]
    mb = lambda key: [s[key] / 1e6 for s in steps]  # noqa: E731
    group = result["cgroup_limit"] is not None
    fig, ax = plt.subplots(3 if group else 2, 1, figsize=(8, 9 if group else 6.5), sharex=True)
    held = [s["step"] for s in steps if s["hog_bytes"]]
    for a in ax:
        if held:
            a.axvspan(min(held) - 0.5, max(held) + 0.5, color="0.9", label="hog holds its memory")
    ax[0].step(x, mb("budget"), where="mid", label="budget (read before the step)")
    ax[0].plot(x, mb("peak"), "o-", label="measured peak RSS of the step")
    ax[0].plot(x, mb("start_rss"), "x--", label="RSS at step start")
    ax[0].set_ylabel("MB")
    ax[0].set_ylim(top=max(mb("budget")) * 1.25)
    ax[0].legend(fontsize=7, loc="upper left", ncols=2)
    ax[0].set_title(f"{result['model']}, batch {result['batch_size']}: budget from {result['budget_source']}, "
                    f"hog {result['hog_bytes'] / 1e6:.0f} MB", fontsize=9)
    if group:
        ax[1].axhline(result["cgroup_limit"] / 1e6, color="C3", label="cgroup limit")
        ax[1].plot(x, mb("cgroup_usage"), "x--", label="cgroup usage at step start (hog included)")
        if all(s["cgroup_peak"] is not None for s in steps):
            ax[1].plot(x, mb("cgroup_peak"), "o-", label="cgroup peak usage during the step")
        ax[1].set_ylabel("MB (trainer + hog)")
        ax[1].set_ylim(top=result["cgroup_limit"] / 1e6 * 1.35)
        ax[1].legend(fontsize=7, loc="upper left", ncols=2)
    t = ax[-1]
    t.plot(x, [s["step_s"] for s in steps], "o-")
    for s in steps:
        bits = "exact" if s["bits"] is None else f"{s['bits']}b"
        t.annotate(f"{s['micro_batches']}x{s['micro_batch_size']} {bits} ck{s['checkpointed']}",
                   (s["step"], s["step_s"]), fontsize=6, rotation=30)
    t.set_ylabel("step time (s)")
    t.set_xlabel("step (plan: micro-batches x size, activation bits, checkpointed blocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a narrow ResNet-18 (width 8), 5 steps, the hog holding at steps 2 and 3: for tests")
    ap.add_argument("--steps", type=int, help="steps in all (default 12)")
    ap.add_argument("--take-at", type=int, help="step at which the hog takes its memory (default steps/3)")
    ap.add_argument("--free-at", type=int, help="step at which the hog frees it (default 2*steps/3)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--width", type=int, help="ResNet-18's first stage width (default 64)")
    ap.add_argument("--room", type=float, default=1.6,
                    help="memory left above what the trainer holds after a warm-up step, in multiples of the plain "
                         "step's activation memory (the limit is set to that)")
    ap.add_argument("--hog", type=float, default=0.8, help="what the hog takes, in the same multiples")
    ap.add_argument("--cgroup", choices=("auto", "on", "off"), default="auto",
                    help="on: fail without a cgroup; off: budget from MemAvailable")
    ap.add_argument("--data", choices=("fashion-mnist", "random"), default="fashion-mnist")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path; the plot is written beside it (.png)")
    args = ap.parse_args()
    steps = args.steps or (5 if args.quick else 12)
    take_at = args.take_at if args.take_at is not None else (2 if args.quick else steps // 3)
    free_at = args.free_at if args.free_at is not None else (4 if args.quick else 2 * steps // 3)
    width = args.width or (8 if args.quick else 64)
    if not 0 < take_at < free_at <= steps:
        ap.error(f"need 0 < --take-at < --free-at <= --steps, got {take_at}, {free_at}, {steps}")

    cgroup, why = (None, "--cgroup off") if args.cgroup == "off" else MemoryCgroup.enter()
    if cgroup is None and args.cgroup == "on":
        ap.error(f"no memory cgroup: {why}")
    try:
        return train(args, steps, take_at, free_at, width, cgroup, why)
    finally:
        if cgroup is not None:
            cgroup.remove()


def train(args: argparse.Namespace, steps: int, take_at: int, free_at: int, width: int,
          cgroup: MemoryCgroup | None, why: str) -> int:
    torch.manual_seed(0)
    n = args.batch_size * steps
    if args.data == "fashion-mnist":
        data = image_dataset("train", size=32, channels=3, limit=n)
        images, labels, classes, source = data.images, data.labels, data.num_classes, data.source
    else:
        images, labels, classes, source = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)), 10, "random"
    batches = [(images[i:i + args.batch_size], labels[i:i + args.batch_size]) for i in range(0, n, args.batch_size)]
    model = daftrain.batchnorm_to_groupnorm(resnet18(num_classes=classes, width=width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tighten_allocator()  # as BudgetedStep(tune_allocator=True): the cgroup's usage follows live memory

    with hog_process() as hog:  # started after joining: the hog is in the trainer's cgroup
        activation = plain_activation_bytes(model, optimizer, *batches[0])
        room, hog_bytes = int(args.room * activation), int(args.hog * activation)
        if cgroup is not None:
            limit = cgroup.usage() + room
            cgroup.set_limit(limit)
            budget = daftrain.Budget.system(FRACTION)
            budget_source = f"cgroup v{cgroup.version} limit"
        else:
            limit = None
            available = read_system_memory().available
            budget = daftrain.Budget.system(FRACTION, reserve=int(FRACTION * max(0, available - room)))
            budget_source = "MemAvailable"
        print(f"budget from {budget_source} ({why if cgroup is None else cgroup.path}); plain step's activations "
              f"{activation / 1e6:.0f} MB, room {room / 1e6:.0f} MB, hog {hog_bytes / 1e6:.0f} MB at steps "
              f"{take_at}..{free_at - 1}; data: {source}", flush=True)
        step = daftrain.BudgetedStep(model, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), optimizer,
                                     budget=budget)
        records, held = [], 0
        for i in range(steps):
            if i == take_at:
                tell(hog, f"take {hog_bytes}")
                held = hog_bytes
            if i == free_at:
                tell(hog, "free")
                held = 0
            mem = read_system_memory()
            per_step_peak = cgroup is not None and cgroup.reset_peak()
            t0 = time.perf_counter()
            loss = step(batches[i])
            call_s = time.perf_counter() - t0
            cgroup_peak = cgroup.peak_usage() if per_step_peak and cgroup is not None else None
            r = step.history[-1]
            rec = {"step": i, "budget": r.budget_bytes, "peak": r.peak_bytes, "start_rss": r.start_rss_bytes,
                   "rss_after": current_rss_bytes(), "hog_bytes": held, "available": mem.available,
                   "memory_source": mem.source, "cgroup_usage": mem.cgroup_current, "cgroup_peak": cgroup_peak,
                   "micro_batches": r.plan.num_micro_batches, "micro_batch_size": r.plan.micro_batch_size,
                   "bits": r.plan.bits, "checkpointed": len(r.plan.checkpointed),
                   "predicted_peak": r.plan.predicted_peak_bytes, "alpha": r.plan.alpha, "step_s": r.step_s,
                   "call_s": call_s, "loss": loss, "over_budget": r.peak_bytes > r.budget_bytes}
            records.append(rec)
            bits = "exact" if r.plan.bits is None else f"{r.plan.bits} bits"
            print(f"step {i:2d}  hog {held / 1e6:5.0f} MB  budget {r.budget_bytes / 1e6:7.1f} MB  peak "
                  f"{r.peak_bytes / 1e6:7.1f} MB  plan {r.plan.num_micro_batches} x {r.plan.micro_batch_size}, "
                  f"{bits}, {len(r.plan.checkpointed)} checkpointed  {r.step_s:5.2f} s  loss {loss:.3f}"
                  f"{'  OVER BUDGET' if rec['over_budget'] else ''}", flush=True)
        step.close()

    over = [r["step"] for r in records if r["over_budget"]]
    result = {
        "model": f"ResNet-18 width {width} (GroupNorm)", "batch_size": args.batch_size, "steps": records,
        "take_at": take_at, "free_at": free_at, "fraction": FRACTION, "budget_source": budget_source,
        "no_cgroup_reason": None if cgroup is not None else why, "data": source,
        "plain_activation_bytes": activation, "room_bytes": room, "hog_bytes": hog_bytes, "cgroup_limit": limit,
        "cgroup": cgroup.events() if cgroup is not None else None, "over_budget_steps": over,
        "process_peak_bytes": step.process_peak_bytes, "loadavg": os.getloadavg(), "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plotted = plot(result, png)
    if cgroup is not None:
        ev = result["cgroup"]
        print(f"cgroup: limit {limit / 1e6:.1f} MB, peak usage {ev['peak_usage'] / 1e6:.1f} MB, limit hit "
              f"{ev['limit_hits']} times, {ev['oom_kills']} OOM kills")
    print(f"wrote {args.out}" + (f" and {png}" if plotted else " (no plot: matplotlib is not installed)"))
    print(f"over budget: {'none' if not over else 'steps ' + ', '.join(map(str, over))}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
