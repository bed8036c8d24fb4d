"""Names a package publishes from its submodules, loaded when first used (PEP 562).

[Note: the public face]
``import shardengine`` offers the few names a training script needs (``shardengine.__all__``,
at most 15); every other public name lives in one documented submodule with one meaning
(``shardengine.distributed``, ``.interop``, ``.data``, ``.optim``, ``.model``, ``.config``,
``.errors``, ...). Two mechanisms serve this, both here:

- a package that publishes names of its submodules (``shardengine.distributed.rank``) loads
  the submodule on first use, not at import: the estimator imports pure modules of these
  packages (``distributed.traffic``, ``data.proportions``) and must not load the process-group
  code beside them;
- a name that used to be at the top (``shardengine.rank``) still resolves, to the same object,
  for one release, with a ``DeprecationWarning`` naming its new home. ``dir()`` and ``__all__``
  show only the new face.

>>> import sys, types
>>> package = types.ModuleType("pkg")
>>> sys.modules["pkg"] = package
>>> package.__getattr__, package.__dir__ = lazy_exports("pkg", {"sqrt": "math"}, public=["sqrt"])
>>> package.sqrt(4.0), "sqrt" in dir(package)
(2.0, True)
>>> del sys.modules["pkg"]
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping


def lazy_exports(package: str, homes: Mapping[str, str], public: Iterable[str], moved: bool = False,
                 submodules: Iterable[str] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``homes`` is read from its module
    (absolute, or relative to ``package``) when first asked for.

    ``moved=True``: the names are old ones kept for one release; each access warns with the new
    import path and is not cached, so every importer sees the warning, and ``dir()`` lists only
    ``public`` (the new face). Otherwise the value is cached on the package, so later reads cost
    nothing, and ``dir()`` lists ``public`` beside the package's own names (its submodules).
    ``submodules`` are imported when first read as attributes (``shardengine.interop``) and
    listed by ``dir()`` too.
    """
    listed, loadable = sorted({*public, *submodules}), set(submodules)

    def __getattr__(name: str) -> Any:
        if name in loadable:
            return importlib.import_module(f"{package}.{name}")
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home, package)
        value = getattr(module, name)
        if moved:
            warnings.warn(f"`{package}.{name}` moved to `{module.__name__}.{name}`; import it as "
                          f"`from {module.__name__} import {name}` (the old name goes in the next release)",
                          DeprecationWarning, stacklevel=2)
        else:
            setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return listed if moved else sorted(set(listed) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
