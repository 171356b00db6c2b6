"""What PyTorch calls back into daftrain while a model runs (saved-tensor hooks, torch function modes' handlers):
never compiled by ``torch.compile`` as a frame of its own (``NOTE [ Callbacks in a compiled function's eager
code ]``)."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Mapping
from types import CodeType
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
except ImportError:  # an older torch: where Dynamo is loaded, a callback may be set
    def get_eval_frame_callback() -> Any:
        return "torch._dynamo" in sys.modules

__all__ = ["EagerMode", "eagerly", "never_a_frame", "skip_frames", "uncompiled"]

_F = TypeVar("_F", bound=Callable[..., Any])


# NOTE [ Callbacks in a compiled function's eager code ]
# Inside a function ``torch.compile`` compiled, what Dynamo leaves out of its graphs runs eagerly with Dynamo's frame
# callback still set: the call at a graph break, and frames Dynamo does not compile on their own (torch.nn's modules: a
# compiled ``nn.Sequential`` whose ``forward`` was wrapped by ``compress_forward``). Every other Python frame entered
# there is compiled alone, and PyTorch enters daftrain's callbacks there: the saved-tensor hooks (from autograd, for
# each save) and the torch function modes' handlers (for each torch call). Each was compiled as a graph of its own,
# recompiled for every new call signature, and in such a one-op graph the tensors the op saves are the graph's inputs,
# which AOTAutograd never offers to hooks: nothing the compiled module saved was compressed, and nothing said so; and
# the op rules never saw the rest of a call that broke the graph (a Gaussian NLL's division by its variance). So each
# callback is never a frame of its own (``never_a_frame``: Dynamo still inlines it where it traces the code that calls
# it, a mode's handler under ``with ctx: compiled(x)``), and its eager work runs with the frame callback off
# (``eagerly``), as in code that was never compiled. A frame a callback calls before ``eagerly`` is compiled on its own
# unless it too is ``never_a_frame``. Marking a frame needs ``torch._dynamo``, which eager-only users never import (its
# import time and memory): the marks wait until it is loaded (``skip_frames``, called where a context is entered and
# where a compiled graph's hooks are traced).
_pending: list[CodeType] = []
_lock = threading.Lock()


def skip_frames() -> None:
    """Mark the frames ``never_a_frame`` named, once ``torch._dynamo`` is loaded."""
    if not _pending or "torch._dynamo" not in sys.modules:
        return
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # an older torch has it in C only
        from torch._C._dynamo.eval_frame import skip_code

    with _lock:
        for code in _pending:
            skip_code(code)
        _pending.clear()


def never_a_frame(fn: _F) -> _F:
    """``fn``, which Dynamo will not compile as a frame of its own (it may still inline it)."""
    with _lock:
        _pending.append(fn.__code__)
    skip_frames()
    return fn


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@functools.cache
def _uncompiled() -> Callable[..., Any]:
    return uncompiled(_call)  # called only where a frame callback is set: Dynamo is loaded


@never_a_frame
def eagerly(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with Dynamo's frame callback off where it is set (nothing ``fn`` calls is compiled)."""
    if not get_eval_frame_callback():  # not inside a compiled function (or one that compiles nothing more)
        return fn(*args)
    skip_frames()
    return _uncompiled()(fn, *args)


def uncompiled(fn: _F) -> _F:
    """``fn`` for a hook registered now that Dynamo would trace into a compiled graph (a module's forward hooks):
    run eagerly at a graph break (``torch.compiler.disable``) once ``torch._dynamo`` is loaded; ``fn`` itself
    before, when nothing can be compiled."""
    if "torch._dynamo" not in sys.modules:
        return fn
    return torch.compiler.disable(fn)  # type: ignore[return-value]


class EagerMode(TorchFunctionMode):
    """A torch function mode whose handler, ``_handle(func, args, kwargs)``, Dynamo inlines where it traces the calls
    and which runs with the frame callback off everywhere else (``NOTE [ Callbacks in a compiled function's eager
    code ]``)."""

    @never_a_frame
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if torch.compiler.is_compiling():
            return self._handle(func, args, kwargs or {})
        return eagerly(self._handle, func, args, kwargs or {})

    def _handle(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        raise NotImplementedError
