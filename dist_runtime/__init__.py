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


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dist_runtime' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
