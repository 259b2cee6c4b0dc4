"""Which backend runs each node: numbered passes after ggml's backend scheduler.

:func:`candidate_backends` lists, for one node, the backends to try in priority order:

1. the node's ``backend_hint``: the backend in use with that ``hint``, if any;
2. the executor's default backend (the first one it was given);
3. the CPU library.

:func:`assign_backends` gives each node the first candidate that supports it, recording why --
and when none does, a ``GraphValidationError`` naming the node (pass 4: never a silent failure).
The fusion pre-pass asks the same candidates whether a fused node would find a backend
(:func:`dist_runtime.fusion.backend_acceptor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import GraphValidationError
from ..ir.graph import Graph, Node, TensorSpec
from ..ir.hints import BackendHint
from . import Backend


@dataclass(frozen=True)
class Candidate:
    backend: Backend | None  # None: no backend in use has the node's hint
    taken: str  # the reason when it takes the node
    declined: str  # the note when it does not

    def takes(self, node: Node, input_specs: Sequence[TensorSpec]) -> bool:
        return self.backend is not None and self.backend.supports(node.op, input_specs)


def candidate_backends(node: Node, backends: Sequence[Backend]) -> list[Candidate]:
    """The backends to try for ``node``, in the order of the module docstring's passes (the
    same backend may appear twice: the default is often the CPU library)."""
    chain = []
    if node.backend_hint is not None:  # pass 1: the hint, never overwritten by later passes
        hint = f"hint {BackendHint(node.backend_hint).name.lower()}"
        # the last backend given with that hint serves it: the CPU library, appended last, keeps cpu
        hinted = {b.hint: b for b in backends}.get(node.backend_hint)
        declined = "not in use" if hinted is None else "does not support it"
        chain.append(Candidate(hinted, hint, f"{hint} {declined}"))
    default = backends[0]
    chain.append(Candidate(default, "default", f"default {default.name} does not support it"))
    cpu = next((b for b in backends if b.name == "cpu"), None)
    chain.append(Candidate(cpu, "fallback to cpu", "cpu has no kernel" if cpu else "cpu not in use"))
    return chain


@dataclass(frozen=True)
class Assignment:
    backend: Backend
    reason: str  # why this backend, for `dist-runtime inspect --plan`


def assign_backends(graph: Graph, specs: dict[str, TensorSpec], backends: list[Backend]) -> list[Assignment]:
    """One backend per node, in the numbered passes of the module docstring."""
    return [_assign(node, [specs[n] for n in node.inputs], backends) for node in graph.nodes]


def _assign(node: Node, in_specs: list[TensorSpec], backends: list[Backend]) -> Assignment:
    notes = []
    for candidate in candidate_backends(node, backends):
        if candidate.takes(node, in_specs):
            detail = getattr(candidate.backend, "detail", None)  # how it runs the node, if it says
            how = detail(node.op, in_specs) if detail is not None else None
            return Assignment(candidate.backend, "; ".join([*notes, candidate.taken, *([how] if how else [])]))
        notes.append(candidate.declined)
    raise GraphValidationError(  # pass 4: never silent
        f"node {node.id} ({node.op_name}): no backend accepts it ({'; '.join(notes)}); "
        f"backends in use: {[b.name for b in backends]}"
    )
