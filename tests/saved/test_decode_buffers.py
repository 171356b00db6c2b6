import gc
import threading

import pytest
import torch
from torch import nn

import daftrain
from daftrain.saved.decode_buffers import DecodeBuffers


def test_a_buffer_is_reused_only_after_its_tensor_dies() -> None:
    buffers = DecodeBuffers()
    a = buffers.take(1000, torch.float32)
    ptr = a.data_ptr()
    b = buffers.take(1000, torch.float32)  # a is alive: a fresh buffer
    assert b.data_ptr() != ptr and buffers.allocated == 2 and buffers.reused == 0
    view = a[10:20].view(2, 5)  # a view keeps the storage, and so the buffer, busy
    del a
    gc.collect()
    c = buffers.take(1000, torch.float32)
    assert c.data_ptr() not in (ptr, b.data_ptr()) and buffers.reused == 0
    del view
    d = buffers.take(1000, torch.float32)
    assert d.data_ptr() == ptr and buffers.reused == 1


def test_sizes_and_dtypes_share_buffers_by_bytes() -> None:
    buffers = DecodeBuffers()
    a = buffers.take(512, torch.float32)
    assert a.dtype == torch.float32 and a.shape == (512,) and a.is_contiguous()
    ptr = a.data_ptr()
    del a
    h = buffers.take(1024, torch.bfloat16)  # the same 2048 bytes
    assert h.dtype == torch.bfloat16 and h.shape == (1024,) and h.data_ptr() == ptr
    other = buffers.take(1000, torch.float32)  # another size never gets this buffer
    assert other.data_ptr() != ptr


def test_free_list_is_bounded_and_released() -> None:
    buffers = DecodeBuffers(max_free_per_size=2)
    held = [buffers.take(4096, torch.float32) for _ in range(5)]
    del held
    assert buffers.free_bytes == 2 * 4096 * 4
    buffers.release()
    assert buffers.free_bytes == 0
    with pytest.raises(ValueError, match="max_free_per_size"):
        DecodeBuffers(max_free_per_size=-1)


def test_no_buffer_is_handed_out_twice_across_threads() -> None:
    buffers = DecodeBuffers()
    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(200):
            t = buffers.take(256, torch.float32)
            t.fill_(k * 1000 + i)
            if not bool((t == k * 1000 + i).all()):
                errors.append(f"thread {k} step {i}: buffer shared")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and buffers.reused > 0


def test_backward_reuses_buffers_and_gradients_are_unchanged() -> None:
    """Decoding into reused buffers gives bit-identical gradients, and a deep net's backward reuses them."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.GELU())])
    x = torch.randn(64, 256)

    def grads(reuse: bool) -> tuple[list[torch.Tensor], daftrain.compress]:
        model.zero_grad()
        ctx = daftrain.compress(bits=2, seed=3, model=model, decode_buffers=reuse)
        for _ in range(2):
            model.zero_grad()
            with ctx:
                loss = model(x).square().mean()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()], ctx

    fresh, _ = grads(reuse=False)
    reused, ctx = grads(reuse=True)
    for a, b in zip(fresh, reused, strict=True):
        assert torch.equal(a, b)
    assert ctx._decode_buffers is not None and ctx._decode_buffers.reused > 0
    with pytest.raises(TypeError, match="decode_buffers"):
        daftrain.CompressionConfig(decode_buffers=1)


def test_free_buffers_are_dropped_when_no_saved_tensor_is_held() -> None:
    # NOTE [ Decode buffers ]: none sits on top of the optimizer step, and buffers coming back after it are
    # dropped until the next take
    buffers = DecodeBuffers()
    buffers.saves_held(True)
    a, b = buffers.take(4096, torch.float32), buffers.take(4096, torch.float32)
    del a
    assert buffers.free_bytes == 4096 * 4
    buffers.saves_held(False)
    assert buffers.free_bytes == 0
    del b  # a decoded tensor that outlived backward: dropped, not kept
    assert buffers.free_bytes == 0
    c = buffers.take(4096, torch.float32)  # the next backward keeps them again
    del c
    assert buffers.free_bytes == 4096 * 4


def test_no_free_buffer_is_held_after_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())])
    ctx = daftrain.compress(bits=2, model=model)
    with ctx:
        loss = model(torch.randn(64, 256)).square().mean()
    loss.backward()
    gc.collect()
    assert ctx._decode_buffers is not None and ctx._decode_buffers.reused > 0
    assert ctx._decode_buffers.free_bytes == 0
