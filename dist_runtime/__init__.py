"""dist-runtime: run models expressed as a graph of ops, split into pipeline stages.

The main entry points, imported lazily (``import dist_runtime`` stays cheap for the CLI):
``GraphExecutor`` (dist_runtime.executor), ``load_model`` / ``save_model`` (dist_runtime.model).
"""

from __future__ import annotations

_LAZY = {
    "GraphExecutor": ("dist_runtime.executor", "GraphExecutor"),
    "load_model": ("dist_runtime.model", "load_model"),
    "save_model": ("dist_runtime.model", "save_model"),
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
