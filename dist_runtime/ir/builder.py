"""Building a list of nodes: what every importer (and any pass that writes nodes) needs.

A :class:`GraphBuilder` appends nodes with consecutive ids, names the outputs it is not given so
that no name repeats, records the weights the nodes read (name and shape, in order of first use)
and the constant tensors it introduces.  Starting from a given id and a set of names already in
use, it can also write nodes into an existing graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .graph import Node
from .ops import Add, Matmul, OpPayload


class GraphBuilder:
    """Appends nodes with consecutive ids from ``next_id``; new names avoid ``taken`` (and every
    name this builder has produced), temporary ones are ``<scope><what><n>``."""

    def __init__(self, next_id: int = 0, taken: Iterable[str] = (), scope: str = "") -> None:
        self.nodes: list[Node] = []
        self.weights: dict[str, tuple[int, ...]] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.next_id = next_id
        self.taken = set(taken)
        self.scope = scope
        self._count = 0

    def fresh(self, base: str) -> str:
        """``base``, or ``base.1``, ``base.2``... the first not yet taken (it is taken now)."""
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}.{k}", k + 1
        self.taken.add(name)
        return name

    def tmp(self, what: str) -> str:
        self._count += 1
        return self.fresh(f"{self.scope}{what}{self._count}")

    def emit(self, op: OpPayload, inputs: Sequence[str], outputs: Sequence[str | None] | str | None = None, *,
             attrs: dict | None = None, backend_hint: int | None = None, node_id: int | None = None):
        """Append a node; ``outputs`` are names (``None`` entries get a temporary name).  Returns
        the output name, or the list of names for a multi-output op.  ``node_id`` keeps an id the
        graph already had (a pass rewriting one node into several); otherwise the next id."""
        n = op.spec.num_outputs(op)
        if outputs is None or isinstance(outputs, str):
            outputs = [outputs] + [None] * (n - 1)
        names = [o or self.tmp(type(op).__name__.lower()) for o in outputs]
        if len(names) != n:
            raise AssertionError(f"{type(op).__name__} has {n} outputs, {len(names)} named")
        self.taken.update(names)
        if node_id is None:
            node_id, self.next_id = self.next_id, self.next_id + 1
        self.nodes.append(Node(node_id, op, list(inputs), names, dict(attrs or {}), backend_hint))
        return names[0] if n == 1 else names

    def weight(self, name: str, *shape: int) -> str:
        """A weight the nodes read; its first shape is kept."""
        self.weights.setdefault(name, shape)
        return name

    def constant(self, what: str, array) -> str:
        """A new tensor of known value, under a temporary name."""
        name = self.tmp(what)
        self.constants[name] = np.asarray(array)
        return name

    def linear(self, x: str, prefix: str, rows: int, cols: int, bias: bool, out: str,
               weight: str | None = None) -> str:
        """``x @ W^T (+ b)`` with W = ``prefix.weight`` [rows, cols] (or ``weight``, a tied
        matrix) and b = ``prefix.bias``."""
        w = weight or self.weight(prefix + ".weight", rows, cols)
        y = self.emit(Matmul(), [x, w], out + "_mm" if bias else out)
        return self.emit(Add(), [y, self.weight(prefix + ".bias", rows)], out) if bias else y
