"""dist-runtime: run models expressed as a graph of ops, split into pipeline stages.

The main entry points, imported lazily (``import dist_runtime`` stays cheap for the CLI):
``GraphExecutor`` (dist_runtime.executor), ``load_model`` / ``save_model`` (dist_runtime.model),
``Sampling`` (dist_runtime.sampling), ``Request`` / ``LocalEngine`` / ``generate``
(dist_runtime.engine; the pipeline's engine is ``Pipeline(...).coordinator``).
"""

from __future__ import annotations

import os as _os

# kernels/ and partitioner/ sit beside this folder in the repository and install as
# dist_runtime.kernels and dist_runtime.partitioner.  A checkout used without installing (the
# project shipped to a cluster as a working directory) finds them here instead.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and \
        _os.path.isfile(_os.path.join(_checkout, "kernels", "__init__.py")):
    __path__.append(_checkout)

_LAZY = {
    "GraphExecutor": ("dist_runtime.executor", "GraphExecutor"),
    "load_model": ("dist_runtime.model", "load_model"),
    "save_model": ("dist_runtime.model", "save_model"),
    "Sampling": ("dist_runtime.sampling", "Sampling"),
    "Request": ("dist_runtime.engine", "Request"),
    "LocalEngine": ("dist_runtime.engine", "LocalEngine"),
    "generate": ("dist_runtime.engine", "generate"),
}

__all__ = list(_LAZY)


def _lazy_exports(package: str, table: dict[str, tuple[str, str]]):
    """A module ``__getattr__`` that imports ``table[name] = (module, attribute)`` on first use."""
    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        module, attr = table[name]
        return getattr(importlib.import_module(module), attr)
    return __getattr__


__getattr__ = _lazy_exports(__name__, _LAZY)
