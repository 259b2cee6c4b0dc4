"""The cost model: per-position arrays that are everything the solver needs.

Positions ``0..n-1`` are nodes in execution order.  A stage is a half-open range ``[a, b)``.

* ``compute[i]``  -- FLOPs of node ``i`` (any non-negative integer work measure).
* ``kv[i]``       -- bytes of persistent per-session state node ``i`` owns (KV caches), already
  multiplied by the sessions in flight.
* ``live[i]``     -- activation bytes live while node ``i`` runs: every tensor produced at or before
  ``i`` and still needed at or after it (including tensors only passing through to a later stage).
  The peak of a stage is ``max(live[a:b])``.
* ``cut[c]``      -- bytes crossing the boundary just before position ``c``: each tensor produced
  before ``c`` and needed at or after ``c`` counts once, however many consumers it has; a tensor
  that skips a stage counts at every boundary it crosses.  ``cut[0]`` holds the graph inputs and
  ``cut[n]`` the graph outputs (what enters the first stage and leaves the last).
* weights -- ``use_pos``/``use_weight`` list each (position, weight) use once; a stage holds the
  union of the weights its nodes use, so a weight shared by nodes in two stages (tied embedding and
  lm_head) is counted in both.

A tensor's lifetime is ``[producer, last]`` with ``producer = -1`` for a graph input (it arrives
before the first node) and ``last = n`` for a graph output (it leaves after the last node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

import numpy as np


class TensorUse(NamedTuple):
    """One activation tensor: ``size`` bytes on the wire, ``act`` bytes held in memory while live
    (0 for a view into state counted elsewhere, such as a KV cache's output), live over
    ``[producer, last]``."""

    name: str
    size: int
    producer: int
    last: int
    act: int | None = None  # None: same as size


@dataclass(frozen=True, eq=False)
class TensorTable:
    """The tensors behind ``live`` and ``cut``, as arrays, so a plan can name what crosses a cut."""

    names: Sequence[str]
    size: np.ndarray  # int64 [T], bytes on the wire
    act: np.ndarray  # int64 [T], bytes held in memory while live
    producer: np.ndarray  # int64 [T], -1 for graph inputs
    last: np.ndarray  # int64 [T], n for graph outputs

    def crossing(self, c: int) -> list[str]:
        """Names of the tensors that cross the boundary before position ``c``, in table order."""
        return crossing(self.names, self.producer, self.last, c)


def crossing(names: Sequence[str], producer: np.ndarray, last: np.ndarray, c: int) -> list[str]:
    """The ``names`` (in their order) whose lifetime ``[producer, last]`` spans the boundary before
    position ``c``: produced before ``c`` and needed at or after it.  The planner's
    ``tensors_in``/``tensors_out`` and the pipeline's stage messages are both this."""
    idx = np.flatnonzero((producer < c) & (last >= c))
    return [names[i] for i in idx.tolist()]


@dataclass(frozen=True, eq=False)
class CostModel:
    compute: np.ndarray  # int64 [n]
    kv: np.ndarray  # int64 [n]
    live: np.ndarray  # int64 [n]
    cut: np.ndarray  # int64 [n + 1]
    weight_names: Sequence[str]
    weight_bytes: np.ndarray  # int64 [W]
    use_pos: np.ndarray  # int64 [U], sorted by (position, weight), each pair once
    use_weight: np.ndarray  # int64 [U]
    node_ids: np.ndarray | None = None  # int64 [n]: graph node id at each position
    ops: Sequence[str] | None = None  # op name at each position, for messages
    tensors: TensorTable | None = None
    #: For a coarsened model: the first fine position of each unit, plus n at the end.
    starts: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.compute)

    def label(self, i: int) -> str:
        """``node 12 (Matmul)``: how messages name the node at position ``i``."""
        nid = int(self.node_ids[i]) if self.node_ids is not None else i
        what = f" ({self.ops[i]})" if self.ops is not None else ""
        return f"node {nid}{what}"

    def stage_weights(self, a: int, b: int) -> list[str]:
        """Names of the weights that nodes ``a..b-1`` use, each once, in order of first use."""
        lo, hi = np.searchsorted(self.use_pos, [a, b], side="left")
        ids = self.use_weight[lo:hi]
        _, first = np.unique(ids, return_index=True)
        return [self.weight_names[i] for i in ids[np.sort(first)].tolist()]

    @classmethod
    def from_parts(
        cls,
        compute: Sequence[int],
        *,
        kv: Sequence[int] | None = None,
        weights: Sequence[Sequence[str]] | None = None,
        weight_bytes: Mapping[str, int] | None = None,
        tensors: Sequence[TensorUse] = (),
        node_ids: Sequence[int] | None = None,
        ops: Sequence[str] | None = None,
    ) -> CostModel:
        """Build from plain lists: ``weights[i]`` names the weights node ``i`` uses, sized by
        ``weight_bytes``; ``tensors`` give ``live`` and ``cut``."""
        n = len(compute)
        compute_arr = _int_array(compute, "compute")
        kv_arr = _int_array(kv if kv is not None else [0] * n, "kv")
        if len(kv_arr) != n:
            raise ValueError("kv must have one entry per node")
        weight_bytes = dict(weight_bytes or {})
        names: dict[str, int] = {}
        pairs: list[tuple[int, int]] = []
        for i, used in enumerate(weights or []):
            for name in dict.fromkeys(used):  # a node using a weight twice holds it once
                pairs.append((i, names.setdefault(name, len(names))))
        pairs.sort()
        use = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        table = tensor_table(tensors, n)
        live, cut = live_and_cut(n, table)
        return cls(
            compute=compute_arr, kv=kv_arr, live=live, cut=cut,
            weight_names=list(names), weight_bytes=_int_array([weight_bytes[w] for w in names], "weight bytes"),
            use_pos=use[:, 0].copy(), use_weight=use[:, 1].copy(),
            node_ids=None if node_ids is None else np.asarray(node_ids, dtype=np.int64),
            ops=ops, tensors=table,
        )


def _int_array(values: Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{what} must not be negative")
    return arr


def tensor_table(tensors: Sequence[TensorUse], n: int) -> TensorTable:
    size = np.array([t.size for t in tensors], dtype=np.int64)
    producer = np.array([t.producer for t in tensors], dtype=np.int64)
    last = np.array([max(t.last, t.producer) for t in tensors], dtype=np.int64)
    if len(tensors) and (producer.min() < -1 or last.max() > n or producer.max() >= n):
        raise ValueError("a tensor's producer must be in [-1, n) and its last use in [producer, n]")
    act = np.array([t.size if t.act is None else t.act for t in tensors], dtype=np.int64)
    return TensorTable([t.name for t in tensors], size, act, producer, last)


def live_and_cut(n: int, table: TensorTable) -> tuple[np.ndarray, np.ndarray]:
    """``live`` and ``cut`` arrays by difference arrays: O(n + tensors), each tensor counted once.

    A tensor live over ``[p, l]`` occupies memory at every position from ``max(p, 0)`` to
    ``min(l, n - 1)`` and crosses every boundary ``c`` with ``p < c <= l``.
    """
    p, l = table.producer, table.last
    act = table.act
    first, final = np.maximum(p, 0), np.minimum(l, n - 1)
    held = first <= final
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, first[held], act[held])
    np.add.at(diff, final[held] + 1, -act[held])
    live = np.cumsum(diff[:n])
    diff = np.zeros(n + 2, dtype=np.int64)
    np.add.at(diff, p + 1, table.size)
    np.add.at(diff, l + 1, -table.size)
    cut = np.cumsum(diff[: n + 1])
    return live, cut
