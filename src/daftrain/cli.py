"""The ``daftrain`` command: ``demo`` (the main job) and ``env`` (what this machine runs)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from collections.abc import Sequence


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field, with the field's attribute docstring as help text."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
    for field in dataclasses.fields(cls):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default,
            help=f"{docs.get(field.name, '')} (default: {field.default})",
        )


def _demo(ns: argparse.Namespace) -> int:
    from .demo.run import DemoArgs, demo

    fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(DemoArgs)}
    demo(DemoArgs(**fields), out_json=ns.json)
    return 0


def _env(ns: argparse.Namespace) -> int:
    import torch

    import daftrain

    from .kernels.registry import kernel_report, load_fast_kernels

    load_fast_kernels(warmup=True)
    # The hybrid reduction chooses per size class at first use; meet the common classes now so the
    # report shows the choices this machine makes (a few milliseconds each).
    for numel, group_size in ((1 << 16, 65536), (1 << 20, 256), (1 << 20, 8192)):
        torch.ops.daftrain.group_minmax(torch.randn(numel), group_size)
    report = {
        "daftrain": daftrain.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "kernels": kernel_report(),
    }
    print(json.dumps(report, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .demo.run import DemoArgs

    parser = argparse.ArgumentParser(prog="daftrain", description="Train deep networks in far less memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser(
        "demo", help="train ResNet-18 on Fashion-MNIST: plain PyTorch vs daftrain, side by side",
        description="Train a CIFAR-style ResNet-18 on real Fashion-MNIST twice, plain PyTorch and daftrain, each "
        "in a fresh process, and print saved-activation memory, peak RSS, step time, loss and test accuracy.",
    )
    _add_dataclass_flags(p_demo, DemoArgs)
    p_demo.add_argument("--json", default=None, help="also write the results to this JSON file")
    p_demo.set_defaults(func=_demo)
    p_env = sub.add_parser("env", help="versions, threads and which kernels run on this machine")
    p_env.set_defaults(func=_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
