"""Losses, distributions and ops whose backward divides by, compares or is singular in what it saves, tried as
a user would: each after a ``Linear`` (256 x 64 values), the input gradient under ``compress(bits=b)`` against
plain PyTorch's, with the op rules and without them (the hooks as before any rule), eager and compiled
(``aot_eager``). Cosines are of one gradient; a NaN is reported as such, a compile error as its message.

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_losses.py
    .venv/bin/python benchmarks/bench_losses.py --cases binary_cross_entropy amax --no-compile
    python benchmarks/bench_losses.py --device cuda --out /tmp/losses_cuda.json

``--device cuda`` runs every case on the GPU (the same values, drawn on the CPU and moved), compressed against
plain PyTorch on that device.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

import daftrain
from daftrain.saved.op_rules import OpTracer

ROWS, WIDTH = 256, 64
_GEN = torch.Generator().manual_seed(5)
TARGET = torch.rand(ROWS, WIDTH, generator=_GEN)
VALUES = torch.randn(ROWS, WIDTH, generator=_GEN)
ONE_HOT = F.one_hot(torch.arange(ROWS) % WIDTH, WIDTH).float()
IMAGE = torch.randn(8, 3, 16, 16, generator=_GEN)
GROUPS = torch.arange(ROWS) % 16  # a graph's 16 nodes, each pooled from 16 rows
SIGNS = torch.arange(ROWS) % 2 * 2.0 - 1.0  # similar and dissimilar pairs

def _clipped_value_loss(h: torch.Tensor) -> torch.Tensor:
    """PPO's value loss: the larger of the squared errors of the value and of its update clipped to 0.2."""
    old = h.detach() + 0.1 * TARGET - 0.05
    clipped = old + (h - old).clamp(-0.2, 0.2)
    return torch.max((h - VALUES) ** 2, (clipped - VALUES) ** 2)


def _total_variation(image: torch.Tensor) -> torch.Tensor:
    """An isotropic total-variation penalty: the length of each pixel's gradient, smoothed by a small eps."""
    dx, dy = image[:, :-1, 1:] - image[:, :-1, :-1], image[:, 1:, :-1] - image[:, :-1, :-1]
    return torch.sqrt(dx ** 2 + dy ** 2 + 1e-8)


def _end_point_error(flow: torch.Tensor) -> torch.Tensor:
    """A 2-D flow's end-point error written out, where most points are nearly right (one in ten is off)."""
    off = VALUES.view_as(flow)
    target = flow.detach() + 1e-3 * off + (TARGET.view_as(flow) > 0.9) * off
    return torch.sqrt(((flow - target) ** 2).sum(1) + 1e-12)


CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "binary_cross_entropy": lambda h: F.binary_cross_entropy(torch.sigmoid(h * 5.0), TARGET, reduction="none"),
    "bce_written_out": lambda h: -(TARGET * torch.log(torch.sigmoid(h * 5.0) + 1e-7)
                                   + (1 - TARGET) * torch.log(1 - torch.sigmoid(h * 5.0) + 1e-7)),
    "cross_entropy_written_out": lambda h: -(ONE_HOT * torch.log(F.softmax(h * 3.0, -1) + 1e-8)),
    "kl_of_probabilities": lambda h: TARGET.softmax(-1) * (TARGET.softmax(-1).log()
                                                           - torch.log(F.softmax(h * 3.0, -1) + 1e-8)),
    "focal": lambda h: -((1 - F.softmax(h * 3.0, -1)) ** 2 * ONE_HOT * torch.log(F.softmax(h * 3.0, -1) + 1e-8)),
    "normal_log_prob": lambda h: torch.distributions.Normal(h, F.softplus(h * 3.0) + 1e-3).log_prob(VALUES),
    "gaussian_nll": lambda h: F.gaussian_nll_loss(h, VALUES, F.softplus(h * 3.0) + 1e-3, reduction="none"),
    "cauchy_log_prob": lambda h: torch.distributions.Cauchy(h, F.softplus(h.flip(0) * 3.0) + 1e-3).log_prob(VALUES),
    "student_t_log_prob": lambda h: torch.distributions.StudentT(F.softplus(h * 3.0) + 1.001, h.flip(0),
                                                                 F.softplus(h.flip(1) * 3.0) + 1e-3).log_prob(VALUES),
    "poisson_nll": lambda h: F.poisson_nll_loss(torch.sigmoid(h * 5.0), TARGET, log_input=False, reduction="none"),
    "division": lambda h: VALUES / (h.abs() + 0.05),
    "soft_sign": lambda h: h / (h.abs() + 0.05),
    "reciprocal": lambda h: 1.0 / (h.abs() + 0.05),
    "square_root": lambda h: torch.sqrt(h.abs() + 1e-4),
    "smooth_abs": lambda h: torch.sqrt(h * h + 1e-6),
    "product": lambda h: h.reshape(ROWS, 16, 4).prod(-1),
    "atan2": lambda h: torch.atan2(h, h * 0.3 + 0.01),
    "lgamma": lambda h: torch.lgamma(h.abs() + 0.01),
    "asin": lambda h: torch.asin(torch.tanh(h) * 0.9999),
    "cdist": lambda h: torch.cdist(h.reshape(16, 16, WIDTH), h.reshape(16, 16, WIDTH).detach() + 0.01),
    "grid_sample": lambda h: F.grid_sample(IMAGE, torch.tanh(h * 2.0).reshape(8, 32, 32, 2), align_corners=False),
    "eigh": lambda h: torch.linalg.eigh(h.reshape(ROWS, 8, 8) + h.reshape(ROWS, 8, 8).transpose(-1, -2))[1].abs(),
    "solve": lambda h: torch.linalg.solve(h.reshape(ROWS, 8, 8), VALUES.reshape(ROWS, 8, 8)),
    "spectral_norm": lambda h: torch.linalg.matrix_norm(h.reshape(ROWS, 8, 8), ord=2),
    "gram_cholesky": lambda h: torch.linalg.cholesky(h.reshape(ROWS, 8, 8) @ h.reshape(ROWS, 8, 8).transpose(-1, -2)
                                                     + 1e-3 * torch.eye(8)).diagonal(dim1=-2, dim2=-1).log(),
    "amax": lambda h: h - h.amax(-1, keepdim=True),
    "max_of_tensor": lambda h: h / h.max().detach() + h.max() * VALUES,
    "scatter_amax": lambda h: torch.zeros(16, WIDTH).scatter_reduce(0, GROUPS[:, None].expand(ROWS, WIDTH), h, "amax",
                                                                    include_self=False),
    "segment_max": lambda h: torch.segment_reduce(h, "max", lengths=torch.full((16,), ROWS // 16)),
    "infinity_norm": lambda h: torch.linalg.vector_norm(h, ord=float("inf"), dim=-1),
    "scatter_prod": lambda h: torch.ones(16, WIDTH).scatter_reduce(0, GROUPS[:, None].expand(ROWS, WIDTH), h, "prod"),
    "maximum_of_two": lambda h: torch.maximum(h, h.flip(0)),
    "logit": lambda h: torch.logit(torch.sigmoid(h * 4.0)),
    "ndtri_of_sigmoid": lambda h: torch.special.ndtri(torch.sigmoid(h * 4.0)),
    "hypot": lambda h: torch.hypot(h, h * 0.1 + 0.001),
    "acosh": lambda h: torch.acosh(h.abs() + 1.0001),
    "softsign": lambda h: F.softsign(h * 10.0),
    "logsumexp": lambda h: torch.logsumexp(h * 3.0, -1),
    "logcumsumexp": lambda h: torch.logcumsumexp(h * 3.0, -1),
    "ppo_clipped_value": lambda h: _clipped_value_loss(h),
    "distance": lambda h: torch.dist(h, h.detach() + 0.001 * VALUES),
    "l1_norm": lambda h: torch.linalg.vector_norm(h, ord=1, dim=-1),
    "margin_ranking": lambda h: F.margin_ranking_loss(h[:, 0], h[:, 1], TARGET[:, 0].sign(), reduction="none"),
    "triplet_margin": lambda h: F.triplet_margin_loss(h, VALUES, h.detach() + 0.05 * VALUES, reduction="none"),
    "l1_loss": lambda h: F.l1_loss(h, TARGET, reduction="none"),
    "hardshrink": lambda h: F.hardshrink(h, 0.5),
    "bce_with_logits": lambda h: F.binary_cross_entropy_with_logits(h * 5.0, TARGET, reduction="none"),
    "charbonnier": lambda h: torch.sqrt((h - TARGET) ** 2 + 1e-12),
    "total_variation": lambda h: _total_variation(h.reshape(ROWS, 8, 8)),
    "log_of_square": lambda h: torch.log(h.square() + 1e-6),
    "cauchy_kernel": lambda h: 1.0 / (1.0 + h * h / 0.01),
    "end_point_error": lambda h: _end_point_error(h.view(ROWS, 2, WIDTH // 2)),
    "cosine_embedding": lambda h: F.cosine_embedding_loss(h, VALUES, SIGNS, reduction="none"),
    "hinge_embedding": lambda h: F.hinge_embedding_loss(h * 20.0, SIGNS[:, None].expand(ROWS, WIDTH),
                                                        reduction="none"),
    "multi_margin": lambda h: F.multi_margin_loss(h * 20.0, torch.arange(ROWS) % WIDTH, reduction="none"),
}


def gradient(case: str, ctx: daftrain.compress | None, compiled: bool) -> torch.Tensor:
    device = torch.get_default_device()
    torch.manual_seed(0)
    linear = torch.nn.Linear(WIDTH, WIDTH, device="cpu").to(device)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu").to(device).requires_grad_()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return CASES[case](linear(x))

    run = torch.compile(fn, backend="aot_eager") if compiled else fn
    with ctx if ctx is not None else torch.enable_grad():
        out = run(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), device="cpu").to(device)
    (grad,) = torch.autograd.grad((out * weights).sum(), x)
    return grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    value = float(F.cosine_similarity(a.reshape(-1).double(), b.reshape(-1).double(), dim=0))
    return value if math.isfinite(value) else float("nan")


def measure(case: str, bits: int, rules: bool, compiled: bool) -> float:
    ctx = daftrain.compress(bits=bits)
    if not rules:
        ctx._op_tracer = OpTracer(rules=())
    try:
        return cosine(gradient(case, ctx, compiled), gradient(case, None, False))
    finally:
        torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--bits", type=int, nargs="*", default=[8, 4, 2])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/singular_backward/losses.json")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.device != "cpu":  # the cases' constants and the tensors they create go to the device
        for name in ("TARGET", "VALUES", "ONE_HOT", "IMAGE", "GROUPS", "SIGNS"):
            globals()[name] = globals()[name].to(args.device)
        torch.set_default_device(args.device)
    warnings.simplefilter("ignore")
    rows = []
    for case in args.cases:
        row: dict[str, object] = {"case": case}
        for bits in args.bits:
            row[f"rules{bits}"] = measure(case, bits, True, False)
            row[f"norules{bits}"] = measure(case, bits, False, False)
        if not args.no_compile:
            try:
                row["compiled2"] = measure(case, 2, True, True)
            except Exception as e:  # a compile error is a result: reported, not fatal
                row["compiled2"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                torch._dynamo.reset()
        rows.append(row)
        print(case, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "case"},
              flush=True)
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
