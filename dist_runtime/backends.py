"""Backends: who executes a node, and how one is chosen.

A backend implements :class:`Backend`.  The numpy kernel library (:class:`CpuBackend`) is always
present; others are registered with :func:`register_backend` (a new backend never requires
touching the executor).  :func:`assign_backends` chooses one per node in numbered passes, after
ggml's backend scheduler, and records the cause of every decision:

1. the node's ``backend_hint``, if a backend with that hint is in use and supports the op;
2. else the executor's default backend (the first one it was given), if it supports the op;
3. else the CPU library;
4. else a ``GraphValidationError`` naming the node -- never a silent failure.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from .errors import GraphValidationError
from .ir.graph import Graph, Node, TensorSpec
from .ir.ops import OpPayload
from .ir.hints import BackendHint
from .tensor import Array

#: ``fn(inputs, ctx) -> outputs``: a node bound to a backend, ready to run.
BoundKernel = Callable[[Sequence[Array], object], tuple]


@runtime_checkable
class Backend(Protocol):
    name: str
    hint: BackendHint  # the value a node's backend_hint uses to ask for this backend

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool: ...

    def bind(self, node: Node) -> BoundKernel: ...

    def execute(self, node: Node, inputs: Sequence[Array], ctx: object) -> tuple: ...

    def quant_matmul(self, x: np.ndarray, w: Array) -> np.ndarray: ...


class CpuBackend:
    """The numpy kernel library (``kernels/``): every op, every dtype the kernels accept."""

    name = "cpu"
    hint = BackendHint.CPU

    def __init__(self) -> None:
        from dist_runtime import kernels  # registers every family module

        self._kernels = kernels.registered()

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
        return type(op) in self._kernels

    def bind(self, node: Node) -> BoundKernel:
        kernel, op = self._kernels[type(node.op)], node.op
        return lambda inputs, ctx: kernel(op, inputs, ctx)

    def execute(self, node: Node, inputs: Sequence[Array], ctx: object) -> tuple:
        return self.bind(node)(inputs, ctx)

    def quant_matmul(self, x: np.ndarray, w: Array) -> np.ndarray:
        from dist_runtime.kernels.quant import quant_matmul

        return quant_matmul(x, w)


_REGISTRY: dict[str, Callable[[], Backend]] = {"cpu": CpuBackend}

#: Backends in their own modules, imported on first use by name (each registers itself).
_OPTIONAL = {"numpy-blas": "dist_runtime.backends_blas", "torch": "dist_runtime.backends_torch",
             "numba": "dist_runtime.backends_numba"}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make a backend available by name (``GraphExecutor(model, backends=[name, ...])``)."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted({*_REGISTRY, *_OPTIONAL})


def default_backends() -> list[str]:
    """What ``backends=None`` means: the compiled small ops (``numba``) when numba is installed,
    then the CPU library."""
    return ["numba"] if importlib.util.find_spec("numba") is not None else []


def make_backends(spec: Sequence[str | Backend] | None) -> list[Backend]:
    """Backend objects from names or instances (None: :func:`default_backends`); the CPU library
    is always appended last."""
    out: list[Backend] = []
    for item in default_backends() if spec is None else spec:
        if isinstance(item, str):
            if item not in _REGISTRY and item in _OPTIONAL:
                try:
                    importlib.import_module(_OPTIONAL[item])
                except ImportError as e:
                    raise GraphValidationError(f"backend {item!r} is not available: {e}") from None
            if item not in _REGISTRY:
                raise GraphValidationError(f"unknown backend {item!r}; available: {available_backends()}")
            item = _REGISTRY[item]()
        out.append(item)
    if not any(b.name == "cpu" for b in out):
        out.append(CpuBackend())
    return out


@dataclass(frozen=True)
class Assignment:
    backend: Backend
    reason: str  # why this backend, for `dist-runtime inspect --plan`


def assign_backends(graph: Graph, specs: dict[str, TensorSpec], backends: list[Backend]) -> list[Assignment]:
    """One backend per node, in the numbered passes of the module docstring."""
    by_hint = {b.hint: b for b in backends}
    default = backends[0]
    cpu = next(b for b in backends if b.name == "cpu")
    out = []
    for node in graph.nodes:
        in_specs = [specs[n] for n in node.inputs]
        notes = []
        if node.backend_hint is not None:  # pass 1: the hint, never overwritten by later passes
            hinted = by_hint.get(node.backend_hint)
            hint_name = BackendHint(node.backend_hint).name.lower()
            if hinted is not None and hinted.supports(node.op, in_specs):
                out.append(Assignment(hinted, f"hint {hint_name}"))
                continue
            notes.append(f"hint {hint_name} " + ("not in use" if hinted is None else "does not support it"))
        if default.supports(node.op, in_specs):  # pass 2: the default backend
            out.append(Assignment(default, "; ".join([*notes, "default"])))
            continue
        notes.append(f"default {default.name} does not support it")
        if cpu.supports(node.op, in_specs):  # pass 3: the CPU library, last
            out.append(Assignment(cpu, "; ".join([*notes, "fallback to cpu"])))
            continue
        raise GraphValidationError(  # pass 4: never silent
            f"node {node.id} ({node.op_name}): no backend accepts it ({'; '.join(notes)}; "
            f"cpu has no kernel); backends in use: {[b.name for b in backends]}"
        )
    return out
