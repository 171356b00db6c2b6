"""One ``bits="auto"`` context shared by two threads, each running its own forward and backward."""

import threading

import pytest
import torch
from torch import nn

import daftrain

pytestmark = pytest.mark.filterwarnings("ignore::daftrain.QuantizationVarianceWarning")

STEPS = 3
TIMEOUT_S = 60


def test_two_threads_run_forward_and_backward_under_one_auto_context():
    """Regression: the second thread's ``__enter__`` popped the first thread's tracer from its own (empty)
    torch-function-mode stack ("trying to pop from empty mode stack"). The barriers force the
    interleaving: both threads are inside the context, and inside their forward, at the same time, on
    every step (adapt_interval=1: every step traces)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    ctx = daftrain.compress(bits="auto", avg_bits=2.0, model=model, adapt_interval=1, seed=3, min_numel=0)
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    errors: list[BaseException] = []
    grads: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        try:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(32, 64, generator=g)
            for _ in range(STEPS):
                weights = [p.detach().clone().requires_grad_() for p in model.parameters()]
                barrier.wait()
                with ctx:
                    barrier.wait()  # both threads have entered
                    h = nn.functional.gelu(nn.functional.linear(x, weights[0], weights[1]))
                    barrier.wait()  # both are halfway through their forward
                    out = nn.functional.linear(h, weights[2], weights[3])
                out.square().mean().backward()
                grads[i] = [w.grad for w in weights]
        except BaseException as e:  # reported below; let the other thread stop waiting
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert sorted(grads) == [0, 1]
    for thread_grads in grads.values():
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in thread_grads)
    # both threads' records fed the estimates: an allocation is in force; and a third thread's forward
    # under the context leaves no tracer behind on its own mode stack
    assert ctx.report() is not None
    with ctx:
        loss = model(torch.randn(4, 64)).sum()
        modes = torch.overrides._get_current_function_mode_stack()
        assert sum(type(m).__name__ == "_SaverMode" for m in modes) == 1  # adapt_interval=1: traced
    assert torch.overrides._get_current_function_mode_stack() == []
    loss.backward()
