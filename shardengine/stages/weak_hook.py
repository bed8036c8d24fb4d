"""Hooks on the user's tensors that do not keep the engine alive.

[Note: why parameter hooks hold the engine weakly]
A hook registered on a parameter lives as long as the parameter, and torch keeps
a tensor's hooks where Python's garbage collector cannot follow (the autograd
graph's C++ nodes). A hook that is a bound method of the engine therefore made a
cycle the collector never freed: ``del model`` left the engine, its flat
buffers, its process groups and their threads alive (measured: three more
threads per rank for every model sharded and dropped, 1,400 per rank after a test
suite). These hooks reach the engine through a weak reference instead; once the
engine is gone they do nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_method_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that calls the bound ``method`` while its object lives, and does nothing after.

    >>> class Engine:
    ...     def on_grad(self, p): return "seen"
    >>> engine = Engine(); hook = weak_method_hook(engine.on_grad)
    >>> hook(None)
    'seen'
    >>> del engine; hook(None) is None
    True
    """
    ref = weakref.WeakMethod(method)

    def hook(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return hook
