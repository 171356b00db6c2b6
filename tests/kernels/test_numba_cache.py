"""numba's on-disk cache: every CPU kernel is compiled with ``cache=True``, so a second process loads the
kernels a first one compiled instead of compiling them again (the demo's first 2-bit step would
otherwise pay the JIT compilation in every process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from numba.core.caching import NullCache
from numba.core.registry import CPUDispatcher

from daftrain.kernels import cpu

_CHILD = """
import json, torch
from numba.core.registry import CPUDispatcher
from daftrain.kernels import cpu, registry
assert registry.load_fast_kernels().cpu == "numba"
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(70_000).to(dtype)
    for bits in (1, 2, 4, 8):
        codes, lo, scale = torch.ops.daftrain.quantize_pack(x, bits, 256, 0)
        torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, 256, x.numel(), dtype)
torch.ops.daftrain.unpack_bool(torch.ops.daftrain.pack_bool(torch.ones(100, dtype=torch.bool)), 100)
stats = {}
for name, obj in vars(cpu).items():
    if isinstance(obj, CPUDispatcher) and obj.signatures:
        s = obj.stats
        stats[name] = [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
print(json.dumps(stats))
"""


def _run_child() -> dict[str, list[int]]:
    src = str(Path(cpu.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_kernel_is_cached() -> None:
    """Every numba function of the module (the kernels and their callees) asks for the on-disk cache."""
    dispatchers = {name: obj for name, obj in vars(cpu).items() if isinstance(obj, CPUDispatcher)}
    assert dispatchers
    uncached = [name for name, obj in dispatchers.items() if isinstance(obj._cache, NullCache)]
    assert not uncached, f"compiled without cache=True: {uncached}"


def test_a_second_process_loads_the_kernels_from_the_cache() -> None:
    """After one process compiled (or loaded) the kernels, a fresh process compiles none of them."""
    _run_child()  # fills the cache where it is still cold
    stats = _run_child()
    assert "_quantize_per_group" in stats and "_dequantize" in stats, stats
    recompiled = {name: hm for name, hm in stats.items() if hm[1]}
    assert not recompiled, f"compiled again in a second process (cache misses): {recompiled}"
    assert stats["_quantize_per_group"][0] > 0 and stats["_dequantize"][0] > 0, stats
