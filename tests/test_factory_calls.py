"""Every tensor daftrain creates names its device and dtype (``NOTE [ Tensors daftrain creates name their device and
dtype ]`` in kernels/cpu.py): read from the source (``ast``), so a new factory call without them fails here, not in a
user's script that called ``torch.set_default_device("cuda")`` or ``torch.set_default_dtype(torch.float64)``."""

from __future__ import annotations

import ast
from pathlib import Path

from torch.utils._device import _device_constructors

SRC = Path(__file__).resolve().parents[1] / "src" / "daftrain"
FACTORIES = {f.__name__ for f in _device_constructors()}


def _unnamed(path: Path, root: Path = SRC) -> list[str]:
    """The factory calls in ``path`` without a ``device=`` or a ``dtype=``, and which they lack."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            missing = [k for k in ("device", "dtype") if not any(kw.arg == k for kw in node.keywords)]
            if missing:
                where = f"{path.relative_to(root)}:{node.lineno}"
                found.append(f"{where} torch.{node.func.attr} without {'/'.join(missing)}")
    return found


def test_the_scan_finds_factory_calls_without_a_device_or_dtype(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text("import torch\nx = torch.zeros(3, dtype=torch.int8, device='cpu')\ny = torch.empty(\n"
                      "    2, dtype=torch.uint8)\nz = torch.linspace(0, 1, 5, device='cpu')\n")
    assert _unnamed(source, tmp_path) == ["example.py:3 torch.empty without device",
                                          "example.py:5 torch.linspace without dtype"]


def test_every_factory_call_names_its_device_and_dtype() -> None:
    # The demo builds the user's model and data: there the defaults are the user's choice.
    found = [call for path in sorted(SRC.rglob("*.py")) if "demo" not in path.relative_to(SRC).parts
             for call in _unnamed(path)]
    assert not found, "tensor factory calls without device= or dtype=: " + ", ".join(found)
