"""Every ``raise`` in the library raises a ``DaftrainError`` with a message that says something.

Read from the source (``ast``), with each raised name resolved in its imported module: a class must derive
from ``daftrain.DaftrainError``; a factory function (``refuse(...)``) must be annotated to return one.
Allowed besides: a bare ``raise``, ``raise name`` of an exception caught by an enclosing ``except ... as
name`` or handed over as a parameter annotated as an exception, and ``raise NotImplementedError`` as the
whole body of a stub (numba overload stand-ins).
``AssertionError`` is raised nowhere."""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

import daftrain
from daftrain import DaftrainError

SRC = Path(daftrain.__file__).resolve().parent


@dataclass(frozen=True)
class RaiseSite:
    module: str
    path: Path
    node: ast.Raise
    function: ast.FunctionDef | ast.AsyncFunctionDef | None
    caught: frozenset[str]  # names bound by enclosing ``except ... as name`` clauses
    in_handler: bool

    def where(self) -> str:
        return f"{self.path.relative_to(SRC.parent)}:{self.node.lineno}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _raise_sites() -> list[RaiseSite]:
    sites: list[RaiseSite] = []

    def visit(node: ast.AST, module: str, path: Path, function, caught: frozenset[str], in_handler: bool) -> None:
        if isinstance(node, ast.Raise):
            sites.append(RaiseSite(module, path, node, function, caught, in_handler))
        for child in ast.iter_child_nodes(node):
            f, c, h = function, caught, in_handler
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                f, c, h = (child if not isinstance(child, ast.Lambda) else function), frozenset(), False
            elif isinstance(child, ast.ExceptHandler):
                c, h = (caught | {child.name}) if child.name else caught, True
            visit(child, module, path, f, c, h)

    for path in sorted(SRC.rglob("*.py")):
        visit(ast.parse(path.read_text(), str(path)), _module_name(path), path, None, frozenset(), False)
    return sites


SITES = _raise_sites()


def _resolve(expr: ast.expr, module: str) -> object:
    """The object a (dotted) name in ``module``'s namespace refers to."""
    names: list[str] = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        raise LookupError(f"cannot resolve {ast.unparse(expr)}")
    namespace = vars(importlib.import_module(module))
    if expr.id in namespace:
        obj = namespace[expr.id]
    else:
        import builtins

        obj = getattr(builtins, expr.id)
    for name in reversed(names):
        obj = getattr(obj, name)
    return obj


def _exception_parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters annotated as exceptions (``error: BaseException | None``)."""
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
            if a.annotation is not None and any(word in ast.unparse(a.annotation)
                                                for word in ("BaseException", "Exception", "Error"))}


def _raised_class(site: RaiseSite) -> type[BaseException] | None:
    """The class a ``raise X(...)`` / ``raise X`` / ``raise factory(...)`` raises; None for a re-raise."""
    exc = site.node.exc
    if exc is None:
        return None
    if isinstance(exc, ast.Name) and exc.id in site.caught:
        return None
    if isinstance(exc, ast.Name) and site.function is not None and exc.id in _exception_parameters(site.function):
        return None  # an exception the caller caught and handed over (``agree_plan(own, error, ...)``)
    target = exc.func if isinstance(exc, ast.Call) else exc
    obj = _resolve(target, site.module)
    if inspect.isclass(obj):
        return obj
    if callable(obj):  # a factory: its return annotation says what it builds
        returned = typing.get_type_hints(obj).get("return")
        assert inspect.isclass(returned), f"{site.where()}: {ast.unparse(target)} has no class return annotation"
        return returned
    raise AssertionError(f"{site.where()}: raises {ast.unparse(exc)}, neither a class nor a factory")


def _is_stub(function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> bool:
    if function is None:
        return False
    body = list(function.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _literal_text(expr: ast.expr) -> str | None:
    """The literal text of a message expression (f-string parts, concatenations); None if it is not one."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in expr.values)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        left, right = _literal_text(expr.left), _literal_text(expr.right)
        if left is not None or right is not None:
            return (left or "{}") + (right or "{}")
    return None


def test_the_scan_finds_the_raises():
    assert len(SITES) > 150  # a broken walk would pass everything below vacuously
    assert any(s.node.exc is None for s in SITES)


@pytest.mark.parametrize("site", SITES, ids=RaiseSite.where)
def test_every_raise_is_a_daftrain_error_or_a_re_raise(site):
    cls = _raised_class(site)
    if site.node.exc is None:
        assert site.in_handler, f"{site.where()}: a bare raise outside an except clause"
        return
    if cls is None:  # a caught or handed-over exception raised again
        return
    assert cls is not AssertionError, f"{site.where()}: AssertionError raised (say what is wrong instead)"
    if cls is NotImplementedError:
        assert _is_stub(site.function), f"{site.where()}: NotImplementedError outside a stub"
        return
    assert issubclass(cls, DaftrainError), (
        f"{site.where()}: raises {cls.__module__}.{cls.__qualname__}, not a daftrain.DaftrainError")


@pytest.mark.parametrize("site", [s for s in SITES if isinstance(s.node.exc, ast.Call)], ids=RaiseSite.where)
def test_every_raised_message_is_a_string_that_names_something(site):
    call = site.node.exc
    assert isinstance(call, ast.Call)
    cls = _raised_class(site)
    if cls is NotImplementedError and _is_stub(site.function):
        return
    args = list(call.args) + [k.value for k in call.keywords]
    assert args, f"{site.where()}: {ast.unparse(call.func)} raised without a message"
    texts = [t for t in map(_literal_text, args) if t is not None]
    for a in args:  # a module-level message constant
        if isinstance(a, ast.Name) and isinstance(obj := vars(importlib.import_module(site.module)).get(a.id), str):
            texts.append(obj)
    if not texts:
        # Only a caught error's message may be passed on as is (``str(exc)``); it is checked where raised.
        a = args[0]
        assert (isinstance(a, ast.Call) and isinstance(a.func, ast.Name) and a.func.id == "str"
                and len(a.args) == 1 and isinstance(a.args[0], ast.Name) and a.args[0].id in site.caught), (
            f"{site.where()}: message {ast.unparse(a)} is not a string")
        return
    words = [w for w in " ".join(texts).replace("{}", " ").split() if sum(ch.isalpha() for ch in w) >= 2]
    assert len(words) >= 3, f"{site.where()}: message {texts!r} names nothing"

def test_a_raise_of_a_foreign_class_is_detected():
    """The check itself can fail: a synthetic module raising ValueError is flagged."""
    tree = ast.parse("def f(x):\n    raise ValueError('x must be positive')\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.Raise))
    site = RaiseSite("daftrain.errors", SRC / "errors.py", node, None, frozenset(), False)
    assert _raised_class(site) is ValueError and not issubclass(ValueError, DaftrainError)
