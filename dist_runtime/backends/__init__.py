"""Backends: who executes a node.

A backend implements :class:`Backend`.  Every backend is named in one registry, :data:`_REGISTRY`:
a name maps to a factory, or to the module that registers the factory on import (so an optional
dependency -- numba -- is imported only when its backend is asked for by name, and a
missing one is named in the error).  :func:`register_backend` adds one; the executor never changes
for it.  Which backend runs a node is :mod:`dist_runtime.backends.assign`'s business.

The backends beside the CPU library (:mod:`.cpu`, always present) are :class:`TableBackend`s:
one :class:`OpEntry` per op payload class they take, so ``supports`` and ``bind`` are lookups
and adding an op to a backend is one table entry.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable


from ..dtypes import DType
from ..errors import GraphValidationError
from ..ir.graph import Node, TensorSpec
from ..ir.hints import BackendHint
from ..ir.ops import OpPayload
from ..tensor import Array

#: ``fn(inputs, ctx) -> outputs``: a node bound to a backend, ready to run.
BoundKernel = Callable[[Sequence[Array], object], tuple]


@runtime_checkable
class Backend(Protocol):
    """What the executor asks of a backend.  Optionally also ``bind_siblings(nodes) -> BoundKernel |
    None``: one kernel for adjacent nodes that read one tensor and a weight each, taking
    ``(x, W_1, .., W_n)`` and returning their outputs (the executor's shared launches; the numba
    backend's products of a layer's q, k and v); None where it would not share a launch.
    ``bind_chain(nodes, kernels, backends) -> (n, BoundKernel) | None``: one kernel for the first
    ``n`` of ``nodes`` (adjacent nodes in graph order, the first this backend's; ``kernels`` their
    kernels as bound on ``backends``, those assigned to them), taking the values :func:`chain_reads` names and returning
    every output of the ``n`` nodes in order, raising :class:`ChainedNodeError` when one of them
    fails (the executor's chains; the numba backend's Rope, Rope, KvCache, Sdpa of a layer).  A
    bound kernel run once per segment of a batched pass may carry ``over_segments(inputs, cuts,
    contexts)``: every segment in one call, returning the pass's values (rows joined, per-segment
    values as ``PerSegment``), or None for the executor to call it segment by segment."""

    name: str
    hint: BackendHint  # the value a node's backend_hint uses to ask for this backend
    #: Whether each row of a node's result is bitwise what the row gives alone, whatever other rows
    #: share the call: what batching sessions into one pass needs (:attr:`GraphExecutor.batch_invariant`).
    batch_invariant: bool

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool: ...

    def bind(self, node: Node) -> BoundKernel: ...

    def execute(self, node: Node, inputs: Sequence[Array], ctx: object) -> tuple: ...


class PerSegment(tuple):
    """A value of a batched pass that is one array per segment (positions, KV histories)."""


class ChainedNodeError(Exception):
    """Raised by a chain's kernel (``bind_chain``) when its node ``offset`` failed with ``error``
    on ``inputs``: the executor reports that node, as if it had run alone."""

    def __init__(self, offset: int, inputs: Sequence, error: Exception) -> None:
        super().__init__(offset, error)
        self.offset, self.inputs, self.error = offset, tuple(inputs), error


def chain_reads(nodes: Sequence[Node]) -> tuple[str, ...]:
    """The values a chain of ``nodes`` reads from outside it, in the order first read."""
    made: set[str] = set()
    reads: dict[str, None] = {}
    for node in nodes:
        reads.update((name, None) for name in node.inputs if name not in made)
        made.update(node.outputs)
    return tuple(reads)


def run_chain(nodes: Sequence[Node], kernels: Sequence[BoundKernel], inputs: Sequence[Array], ctx) -> tuple:
    """A chain's nodes one after another, each on its own kernel: what a chain's kernel does off
    its fast path (``ctx`` is every node's: the chain holds at most one stateful node)."""
    values = dict(zip(chain_reads(nodes), inputs))
    outputs: list = []
    for offset, (node, kernel) in enumerate(zip(nodes, kernels)):
        args = [values[name] for name in node.inputs]
        try:
            outs = kernel(args, ctx)
        except Exception as e:  # noqa: BLE001 -- handed to the executor, which names the node
            raise ChainedNodeError(offset, args, e) from e
        values.update(zip(node.outputs, outs))
        outputs += outs[:len(node.outputs)]
    return tuple(outputs)


class OpEntry(NamedTuple):
    """What a :class:`TableBackend` knows of one op: whether it takes a node of it with these
    input specs (its element types already checked), and how to bind one."""

    supports: Callable[[OpPayload, Sequence[TensorSpec]], bool]
    bind: Callable[..., BoundKernel]


class TableBackend:
    """``supports`` and ``bind`` as lookups in the class's :attr:`ops` table.

    ``bind`` calls the entry's binder with ``(self, node)``; a subclass whose binders all take
    the same extra state overrides :meth:`bind` and passes that instead (see ``blas.py``).
    """

    name: ClassVar[str]
    ops: ClassVar[Mapping[type, OpEntry]]
    dtypes: ClassVar[frozenset[DType]]  # the element types of every input it computes with

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
        entry = self.ops.get(type(op))
        return (entry is not None and all(s.dtype in self.dtypes for s in input_specs)
                and entry.supports(op, input_specs))

    def entry(self, node: Node) -> OpEntry:
        """The node's table entry, or a ValueError naming the node."""
        entry = self.ops.get(type(node.op))
        if entry is None:
            raise ValueError(f"{self.name} has no kernel for node {node.id} ({node.op_name})")
        return entry

    def bind(self, node: Node) -> BoundKernel:
        return self.entry(node).bind(self, node)

    def execute(self, node: Node, inputs: Sequence[Array], ctx: object) -> tuple:
        return self.bind(node)(inputs, ctx)


#: Every backend by name: its factory, or the module whose import registers it (replacing the
#: module name here with the factory).
_REGISTRY: dict[str, Callable[[], Backend] | str] = {
    "cpu": "dist_runtime.backends.cpu",
    "numpy-blas": "dist_runtime.backends.blas",
    "numba": "dist_runtime.backends.numba",
    "numba-f32": "dist_runtime.backends.numba",  # the same, activations f32 whatever the weights
    "numba-q8": "dist_runtime.backends.numba",  # the same, activations quantized as llama.cpp does
}

#: ``--numerics NAME``: the compiled backend that multiplies the weights so (see NumbaBackend).
NUMERICS = {"auto": "numba", "f32": "numba-f32", "q8": "numba-q8"}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make a backend available by name (``GraphExecutor(model, backends=[name, ...])``)."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """Every registered name, whether or not its optional dependency is installed."""
    return sorted(_REGISTRY)


def default_backends(numerics: str = "auto") -> list[str]:
    """What ``backends=None`` means: the compiled small ops (``numba``, its products' activations
    as ``numerics`` says: :data:`NUMERICS`) when numba is installed, then the CPU library."""
    if numerics not in NUMERICS:
        raise ValueError(f"--numerics {numerics!r} is not one of {', '.join(NUMERICS)}")
    return [NUMERICS[numerics]] if importlib.util.find_spec("numba") is not None else []


def make_backend(name: str) -> Backend:
    """A new backend by registered name; a GraphValidationError for an unknown name or a
    missing optional dependency."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise GraphValidationError(f"unknown backend {name!r}; available: {available_backends()}")
    if isinstance(factory, str):
        try:
            importlib.import_module(factory)
        except ImportError as e:
            raise GraphValidationError(f"backend {name!r} is not available: {e}") from None
        factory = _REGISTRY[name]
    return factory()


def set_threads(n: int) -> None:
    """Threads the compiled kernels of this process use (a stage's CPU share)."""
    from .compiled import set_threads as compiled_threads

    compiled_threads(n)


def threads_in_use() -> str:
    """The compiled kernels' threads here: how many, on which layer, and why."""
    import numba

    from . import compiled

    compiled.init()
    return f"{numba.get_num_threads()} on {compiled.threads.LAYER}: {compiled.threads.REASON}"


def make_backends(spec: Sequence[str | Backend] | None, numerics: str | None = None) -> list[Backend]:
    """Backend objects from names or instances (None: :func:`default_backends` for ``numerics``,
    which only that default takes); the CPU library is always appended last."""
    if spec is not None and numerics is not None:
        raise ValueError("give backends or numerics, not both (numerics chooses the default backend)")
    out = [make_backend(item) if isinstance(item, str) else item
           for item in (default_backends(numerics or "auto") if spec is None else spec)]
    if not any(b.name == "cpu" for b in out):
        out.append(make_backend("cpu"))
    return out
