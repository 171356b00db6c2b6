"""Payloads, pools and assertions shared by the pool tests (``tests/pool`` is on ``sys.path``)."""

from __future__ import annotations

import torch

import daftrain  # noqa: F401  (registers the ops)
from daftrain.pool import AdaptiveGrowth, PagePool, PoolConfig

PS = 4096  # small pages keep the tests fast and the page arithmetic readable
G = 256


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(as_bytes(g), as_bytes(w))


def raw(nbytes: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen),)


def quantized(numel: int, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    codes, lo, scale = torch.ops.daftrain.quantize_pack(x, bits, G, seed)
    return (codes, lo, scale)


def demoter(numel: int, dtype: torch.dtype = torch.float32, calls: list | None = None):
    """A demote callback for a (codes, lo, scale) payload: decode, re-quantize at half the bits."""

    def demote(payload):
        codes, lo, scale = payload
        bits = codes.shape[1] * 8 // G
        if calls is not None:
            calls.append(bits)
        if bits <= 1:
            return None
        x = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, G, numel, dtype)
        c, lo2, s = torch.ops.daftrain.quantize_pack(x, bits // 2, G, 1234)
        return (c, lo2, s)

    return demote


def pool(**kw) -> PagePool:
    kw.setdefault("page_size", PS)
    kw.setdefault("growth", AdaptiveGrowth(min_step_bytes=16 * PS))
    return PagePool(PoolConfig(**kw))


def assert_empty(p: PagePool) -> None:
    p.check()
    s = p.stats()
    assert s.records == 0 and s.used_bytes == 0 and s.payload_bytes == 0
    assert s.free_pages == s.total_pages and s.spilled_bytes == 0 and s.spilled_records == 0


def run_step(p: PagePool, nbytes: list[int]) -> None:
    recs = [p.store(raw(n, 0), 1.0) for n in nbytes]
    for r in reversed(recs):
        r.release()
    p.end_step()

