"""Live heap memory per op: which ops a step's live-memory peak sits at, forward and backward apart.

glibc's mmap threshold is fixed at 64 KiB (freed blocks go back at once) and a TorchDispatchMode reads
``mallinfo2``'s bytes in use (heap plus mmapped blocks, the model included) after every op; printed per phase:
the largest reading and the eight op names with the largest readings, for the last of three steps of
``compress(bits=2)``.

    PYTHONPATH=SRC HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/results/chunks_stored_apart/live_peaks.py [MODEL]
"""

import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import daftrain
from daftrain.allocator import _mallinfo2_fn, tighten_allocator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_peak_memory import build

mallinfo2 = _mallinfo2_fn()
assert mallinfo2 is not None and tighten_allocator(1 << 16), "needs glibc's mallinfo2 and mallopt"


class LiveByOp(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "fwd"
        self.peaks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        info = mallinfo2()
        name, peaks = func.overloadpacket.__name__, self.peaks[self.phase]
        peaks[name] = max(peaks[name], info.uordblks + info.hblkhd)
        return out


torch.set_num_threads(2)
model, batch, loss_fn = build(sys.argv[1] if len(sys.argv) > 1 else "minilm_lora_sdpa")
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ctx = daftrain.compress(bits=2, model=model, tune_allocator=False)
for _ in range(3):
    mode = LiveByOp()
    with mode:
        with ctx:
            loss = loss_fn(model, batch)
        mode.phase = "bwd"
        loss.backward()
        del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
for phase, peaks in mode.peaks.items():
    top = " ".join(f"{name}:{nbytes / 1e6:.0f}" for name, nbytes in peaks.most_common(8))
    print(f"{phase}: in use at most {max(peaks.values()) / 1e6:.1f} MB; by op (MB): {top}")
