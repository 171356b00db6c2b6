"""The ``daftrain`` command: ``demo`` (the main job) and ``env`` (what this machine runs)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys
from collections.abc import Callable, Sequence

from .errors import InvalidArgumentError


class FlagError(InvalidArgumentError, argparse.ArgumentTypeError):
    """A command-line value daftrain cannot use; argparse prints it as a usage error (exit status 2)."""


def _field_type(field: dataclasses.Field, check: Callable[[str, object], None]) -> Callable[[str], object]:
    """argparse ``type=`` for one field: parse the text as the field's type, then ``check(name, value)``;
    an invalid value becomes an argparse error naming the flag (exit status 2)."""
    parse = type(field.default)

    def convert(text: str) -> object:
        try:
            value = parse(text)
        except ValueError:
            raise FlagError(f"{field.name} must be {'an integer' if parse is int else 'a number'}, "
                             f"got {text!r}") from None
        try:
            check(field.name, value)
        except InvalidArgumentError as exc:
            raise FlagError(str(exc)) from None
        return value

    convert.__name__ = parse.__name__
    return convert


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, check: Callable[[str, object], None]) -> None:
    """One ``--flag`` per field, with the field's attribute docstring as help text, its value checked by
    ``check(name, value)`` as it is parsed."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[union-attr]
    for field in dataclasses.fields(cls):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=_field_type(field, check), default=field.default,
            help=f"{docs.get(field.name, '')} (default: {field.default})",
        )


def _demo(ns: argparse.Namespace) -> int:
    from .demo.run import DemoArgs, demo

    fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(DemoArgs)}
    demo(DemoArgs(**fields), out_json=ns.json)
    return 0


def _json_path(text: str) -> str:
    """argparse ``type=`` of ``--json``: the file must be writable (its directory is created if missing)
    before any training runs, so a bad path fails now, not after both runs."""
    from .demo.run import prepare_json_path

    try:
        prepare_json_path(text)
    except InvalidArgumentError as exc:
        raise FlagError(str(exc)) from None
    return text


def _env(ns: argparse.Namespace) -> int:
    import torch

    import daftrain

    from .kernels.registry import kernel_report, load_fast_kernels

    load_fast_kernels(warmup=True)
    # The hybrid reduction chooses per size class at first use; meet the common classes now so the
    # report shows the choices this machine makes (a few milliseconds each).
    for numel, group_size in ((1 << 16, 65536), (1 << 20, 256), (1 << 20, 8192)):
        torch.ops.daftrain.group_minmax(torch.randn(numel, dtype=torch.float32, device="cpu"), group_size)
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
    from .demo.run import DemoArgs, check_demo_arg

    parser = argparse.ArgumentParser(prog="daftrain", description="Train deep networks in far less memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser(
        "demo", help="train ResNet-18 on Fashion-MNIST: plain PyTorch vs daftrain, side by side",
        description="Train a CIFAR-style ResNet-18 on real Fashion-MNIST twice, plain PyTorch and daftrain, each "
        "in a fresh process, and print saved-activation memory, peak RSS, step time, loss and test accuracy.",
    )
    _add_dataclass_flags(p_demo, DemoArgs, check_demo_arg)
    p_demo.add_argument("--json", default=None, type=_json_path,
                        help="also write the results to this JSON file (its directory is created if missing)")
    p_demo.set_defaults(func=_demo)
    p_env = sub.add_parser("env", help="versions, threads and which kernels run on this machine")
    p_env.set_defaults(func=_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
