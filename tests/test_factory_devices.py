"""Every tensor daftrain creates names its device (``NOTE [ Tensors daftrain creates name their device ]`` in
kernels/cpu.py): read from the source (``ast``), so a new factory call without one fails here, not in a user's
script that called ``torch.set_default_device("cuda")``."""

from __future__ import annotations

import ast
from pathlib import Path

from torch.utils._device import _device_constructors

SRC = Path(__file__).resolve().parents[1] / "src" / "daftrain"
FACTORIES = {f.__name__ for f in _device_constructors()}


def _calls_without_device(path: Path, root: Path = SRC) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            found.append(f"{path.relative_to(root)}:{node.lineno} torch.{node.func.attr}")
    return found


def test_the_scan_finds_a_factory_call_without_a_device(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text("import torch\nx = torch.zeros(3, device='cpu')\ny = torch.empty(\n    2, dtype=torch.uint8)\n")
    assert _calls_without_device(source, tmp_path) == ["example.py:3 torch.empty"]


def test_every_factory_call_names_its_device() -> None:
    # The demo builds the user's model and data: there the default device is the user's choice.
    found = [call for path in sorted(SRC.rglob("*.py")) if "demo" not in path.relative_to(SRC).parts
             for call in _calls_without_device(path)]
    assert not found, "tensor factory calls without device=: " + ", ".join(found)
