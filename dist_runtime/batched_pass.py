"""Passes that carry the rows of several sessions at once (continuous batching).

A batched pass runs a graph over *segments*: each is one session's rows at that session's position,
and the graph's inputs hold every segment's rows concatenated along axis 0 in segment order.  How
each node treats those rows is its op's row kind, declared in the op table (``OpSpec.rows``,
docs/ops.md "Rows of several sessions"):

- ``independent`` -- each row is computed alone (products, norms, activations, embeddings): one
  call over every segment's rows, so each weight is read once for all sessions;
- ``positional`` -- each row by its own position (Rope, PosEmbed): one call per segment, with that
  segment's ``pos``;
- ``per-session`` -- reads a session's state or its other rows (KvCache appends to the segment's
  own session; Sdpa attends a segment to its own session's keys only; Sample draws from the
  session's generator): one call per segment;
- ``mixed`` -- rows combine in a way segments cannot separate (a convolution over time, a reshape
  across rows): a graph with one runs one session per pass, and :func:`plan_rows` says why.

Values of a batched pass are of three sorts: constants (weights, and what is computed from them
alone), *rows* (row-aligned with the concatenated inputs: one array whose axis 0 is every
segment's rows) and *per segment* (:class:`PerSegment`, one array per segment: the injected
``pos`` and a KvCache's whole K/V history, whose lengths differ by session).  :func:`plan_rows`
works out, once per graph, which node runs how and which of its reads are sliced by segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from .backends import PerSegment  # noqa: F401  (re-exported: a batched pass's per-segment values)
from .ir.graph import POS, Graph, TensorSpec
from .ir.ops import KvCache
from .ir.payload import ALONG_DIM, INDEPENDENT, MIXED

CONST, ROWS, SEGMENTED = "const", "rows", "per segment"


@dataclass(frozen=True)
class Segment:
    """``rows`` rows of ``session`` in a batched pass, at ``pos`` (None: the session's position)."""

    session: Hashable
    rows: int
    pos: int | None = None


@dataclass(frozen=True)
class NodeRows:
    """How one node runs in a batched pass."""

    per_segment: bool  # called once per segment (else once over every segment's rows)
    sliced: tuple[bool, ...]  # per input: a rows value, cut to the segment's rows per call


@dataclass(frozen=True)
class RowPlan:
    """:func:`plan_rows`' answer: ``reason`` is None when the graph can batch sessions, else why
    it runs one session per pass; ``nodes`` is per node, in graph order."""

    reason: str | None
    nodes: tuple[NodeRows, ...]
    values: Mapping[str, str]  # every value's sort: CONST, ROWS or SEGMENTED


def plan_rows(graph: Graph, specs: Mapping[str, TensorSpec]) -> RowPlan:
    """Classify every node and value of ``graph`` (``specs``: its inferred shapes, dynamic dims
    -1) for batched passes; see the module docstring."""
    sort: dict[str, str] = {name: CONST for name in graph.weights}
    sort[POS] = SEGMENTED
    reason = None
    for name, spec in zip(graph.input_names, graph.inputs):
        sort[name] = ROWS
        reason = reason or _rows_axis_problem(f"input {name!r}", spec)
    nodes = []
    for node in graph.nodes:
        reads = [sort.get(name, CONST) for name in node.inputs]
        kind = node.op.spec.row_kind(node.op)
        depends = any(r != CONST for r in reads)
        where = f"node {node.id} ({node.op_name})"
        if depends and kind == MIXED:
            reason = reason or f"{where} mixes rows: its op's rows are 'mixed' (docs/ops.md)"
        if any(reads[i] != CONST for i in node.op.spec.weight_inputs if i < len(reads)):
            reason = reason or f"{where} multiplies two activations: the rows of its sessions would mix"
        if depends and node.op.spec.rows == ALONG_DIM and any(
                r == ROWS and len(specs[n].shape) < 2 for n, r in zip(node.inputs, reads)):
            reason = reason or f"{where} acts along the last dim of a 1-D value: its rows"
        per_segment = depends and (kind != INDEPENDENT or SEGMENTED in reads)
        out = (CONST if not depends else SEGMENTED if isinstance(node.op, KvCache) or ROWS not in reads
               else ROWS)
        for name in node.outputs:
            sort[name] = out
            if out == ROWS and name in specs:
                reason = reason or _rows_axis_problem(f"{where}'s output {name!r}", specs[name])
        nodes.append(NodeRows(per_segment, tuple(r == ROWS for r in reads)))
    for name in graph.outputs:
        if sort.get(name) == SEGMENTED:
            reason = reason or f"output {name!r} is per session (a KvCache's history): it cannot be split by row"
    return RowPlan(reason, tuple(nodes), sort)


def _rows_axis_problem(what: str, spec: TensorSpec) -> str | None:
    """Why a rows value of this shape cannot be cut by segment (its rows must be axis 0, the only
    dynamic dim), or None."""
    dynamic = [i for i, d in enumerate(spec.shape) if d < 0]
    if dynamic != [0]:
        return f"{what} is {spec}: a batched pass needs its rows on axis 0 as its only dynamic dim"
    return None


def offsets(segments: Sequence[Segment]) -> list[slice]:
    """Each segment's rows in the concatenated values."""
    out, at = [], 0
    for seg in segments:
        out.append(slice(at, at + seg.rows))
        at += seg.rows
    return out
