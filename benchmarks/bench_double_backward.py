"""Training that differentiates its own backward (``create_graph=True``), tried as a user would: gradient
penalties, physics-informed residuals, Hessian-vector products, a meta-learning inner step and input-gradient
regularisation, on Fashion-MNIST images where the task takes images. Each case's parameter gradient under
``compress(bits=b)`` (the default, and with ``double_backward=True``) against plain PyTorch's, one step from
the same seeds, and that step's saved-bytes ratio; an exception is reported as
its type and first line. With the code before the option
(``PYTHONPATH=<old>/src``) the ``double_backward`` column reads "no option".

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_double_backward.py
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

import daftrain
from daftrain.demo.data import load_fashion_mnist

Case = Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]


@functools.cache
def _test_split() -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST's test images and labels, read once (every case builds its inputs again per run)."""
    return load_fashion_mnist("test")


def _images(n: int) -> torch.Tensor:
    return (_test_split()[0][:n].float().unsqueeze(1) / 255.0 - 0.2860) / 0.3530


def _labels(n: int) -> torch.Tensor:
    return _test_split()[1][:n]


def _conv_critic(act: Callable[[], nn.Module], norm: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(1, 32, 4, 2, 1), act(), nn.Conv2d(32, 64, 4, 2, 1)]
    layers += [nn.GroupNorm(8, 64)] if norm else []
    return nn.Sequential(*layers, act(), nn.Flatten(), nn.Linear(64 * 7 * 7, 1))


def _gradient_penalty(act: Callable[[], nn.Module], norm: bool) -> Case:
    """WGAN-GP: the critic's gradient norm at points between real and shifted images held near 1."""
    def case() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        critic, real = _conv_critic(act, norm), _images(64)
        fake = real.flip(0) * 0.5 + 0.1 * torch.randn(real.shape, generator=torch.Generator().manual_seed(2))
        mix = torch.rand(64, 1, 1, 1, generator=torch.Generator().manual_seed(3))

        def loss(m: nn.Module) -> torch.Tensor:
            x = (mix * real + (1 - mix) * fake).requires_grad_()
            (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
            return m(fake).mean() - m(real).mean() + 10 * (g.flatten(1).norm(dim=1) - 1).square().mean()
        return critic, loss
    return case


def _r1_penalty() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """StyleGAN's R1: the squared gradient norm of the critic at real images."""
    critic, real = _conv_critic(lambda: nn.LeakyReLU(0.2), False), _images(64)

    def loss(m: nn.Module) -> torch.Tensor:
        x = real.clone().requires_grad_()
        out = m(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return F.softplus(-out).mean() + 5 * g.flatten(1).square().sum(1).mean()
    return critic, loss


def _pinn(act: Callable[[], nn.Module], dtype: torch.dtype = torch.float32) -> Case:
    """A physics-informed network for the heat equation u_t = 0.1 u_xx: the residual needs u's second
    derivative in x, the backward of a backward (such networks are often trained in float64)."""
    def case() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        net = nn.Sequential(nn.Linear(2, 128), act(), nn.Linear(128, 128), act(), nn.Linear(128, 128), act(),
                            nn.Linear(128, 1)).to(dtype)
        points = (torch.rand(2048, 2, generator=torch.Generator().manual_seed(4)) * 2 - 1).to(dtype)

        def loss(m: nn.Module) -> torch.Tensor:
            xt = points.clone().requires_grad_()
            u = m(xt)
            (du,) = torch.autograd.grad(u.sum(), xt, create_graph=True)
            (d2u,) = torch.autograd.grad(du[:, 0].sum(), xt, create_graph=True)
            residual = du[:, 1] - 0.1 * d2u[:, 0]
            return residual.square().mean() + (u[:, 0] - torch.sin(math.pi * points[:, 0])).square().mean()
        return net, loss
    return case


def _classifier(inplace_silu: bool) -> nn.Module:
    act = (lambda: nn.SiLU(inplace=True)) if inplace_silu else nn.ReLU
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), act(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), act(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, 10))


def _hessian_vector(inplace_silu: bool) -> Case:
    """The gradient of g . v for the loss's weight gradient g and a fixed v: a Hessian-vector product
    (sharpness-aware and second-order optimisers, curvature probes)."""
    def case() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
        model, x, y = _classifier(inplace_silu), _images(128), _labels(128)

        def loss(m: nn.Module) -> torch.Tensor:
            params = [p for p in m.parameters()]
            grads = torch.autograd.grad(F.cross_entropy(m(x), y), params, create_graph=True)
            gen = torch.Generator().manual_seed(5)
            return sum((g * torch.randn(g.shape, generator=gen)).sum() for g in grads)
        return model, loss
    return case


def _input_gradient_regularisation() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """Double backpropagation (Drucker and LeCun): cross-entropy plus the squared norm of its input gradient."""
    model, x, y = _classifier(False), _images(128), _labels(128)

    def loss(m: nn.Module) -> torch.Tensor:
        inputs = x.clone().requires_grad_()
        ce = F.cross_entropy(m(inputs), y)
        (g,) = torch.autograd.grad(ce, inputs, create_graph=True)
        return ce + 0.1 * g.square().sum()
    return model, loss


def _maml() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """One MAML inner step: the query loss after an SGD step on the support set, differentiated through it."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.GELU(), nn.Linear(256, 10))
    x, y = _images(128), _labels(128)

    def loss(m: nn.Module) -> torch.Tensor:
        params = dict(m.named_parameters())
        support = F.cross_entropy(torch.func.functional_call(m, params, (x[:64],)), y[:64])
        grads = torch.autograd.grad(support, list(params.values()), create_graph=True)
        adapted = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads, strict=True)}
        return F.cross_entropy(torch.func.functional_call(m, adapted, (x[64:],)), y[64:])
    return model, loss


CASES: dict[str, Case] = {
    "wgan_gp_leaky_relu": _gradient_penalty(lambda: nn.LeakyReLU(0.2), False),
    "wgan_gp_groupnorm_silu": _gradient_penalty(nn.SiLU, True),
    "r1_penalty": _r1_penalty,
    "pinn_tanh": _pinn(nn.Tanh),
    "pinn_silu": _pinn(nn.SiLU),
    "pinn_gelu": _pinn(nn.GELU),
    "pinn_tanh_float64": _pinn(nn.Tanh, torch.float64),
    "hessian_vector_relu": _hessian_vector(False),
    "hessian_vector_silu_inplace": _hessian_vector(True),
    "input_gradient_regularisation": _input_gradient_regularisation,
    "maml_gelu": _maml,
}


def parameter_gradient(case: str, ctx: daftrain.compress | None) -> torch.Tensor:
    torch.manual_seed(0)
    model, loss = CASES[case]()
    with ctx if ctx is not None else torch.enable_grad():
        value = loss(model)
    value.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def measure(case: str, reference: torch.Tensor, **options: object) -> tuple[float | str, float | None]:
    """The gradient's cosine with plain's (or why there is none) and the saved-bytes ratio of the step."""
    try:
        ctx = daftrain.compress(**options)  # type: ignore[arg-type]
    except TypeError:
        return "no option", None
    try:
        got = parameter_gradient(case, ctx)
    except Exception as e:  # an exception is a result: reported, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", None
    value = float(F.cosine_similarity(got.double(), reference.double(), dim=0))
    return (value if math.isfinite(value) else float("nan")), ctx.stats.ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--bits", type=int, nargs="*", default=[8, 4, 2])
    parser.add_argument("--out", default="benchmarks/results/double_backward/double_backward.json")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for case in args.cases:
        reference = parameter_gradient(case, None)
        row: dict[str, object] = {"case": case}
        for bits in args.bits:
            row[f"default{bits}"], row[f"default_ratio{bits}"] = measure(case, reference, bits=bits)
            row[f"double_backward{bits}"], row[f"ratio{bits}"] = measure(case, reference, bits=bits,
                                                                         double_backward=True)
        rows.append(row)
        print(case, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items() if k != "case"},
              flush=True)
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
