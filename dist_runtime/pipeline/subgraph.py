"""Cutting a plan's stages out of the graph: what each stage runs, receives, sends and maps.

A stage runs the contiguous range ``plan.order[start:stop]`` of the graph's nodes.  Every tensor
has a lifetime ``[producer, last use]`` in that order (a graph input is produced at -1, a graph
output is used at n, after the last node).  A stage ``[a, b)`` then

* **receives** every tensor that crosses the boundary before ``a`` (produced before ``a``, used
  at or after ``a``) -- what the partitioner's ``Stage.tensors_in`` lists, by the same function
  (``partitioner.costs.crossing``) over this module's lifetimes (Sample nodes dropped);
* **sends** every tensor that crosses the boundary before ``b`` -- ``Stage.tensors_out``;
* **forwards** what it both receives and sends: a tensor that skips the stage (or that it reads
  and a later stage reads too) travels on unchanged, outside its executor;
* maps exactly the weights its nodes read.

The graph's own ``Sample`` nodes are left out: sampling happens on the driver, per session, with
the session's settings and seed (a sampler baked into the graph would have one setting for every
session).  The logits a ``Sample`` node reads become a graph output instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dist_runtime.partitioner.costs import crossing as tensors_crossing

from ..engine import driver_outputs
from ..errors import GraphValidationError
from ..ir.graph import Graph, Node, TensorSpec
from ..ir.ops import Sample
from ..ir.validate import infer_shapes


@dataclass(frozen=True)
class StageGraph:
    """What one stage actor needs to run its part: picklable, with no weights in it."""

    index: int
    graph: Graph | None  # the stage's nodes as a graph for GraphExecutor; None for an empty stage
    receives: tuple[str, ...]  # in message order
    sends: tuple[str, ...]
    forwards: tuple[str, ...]  # received and sent on unchanged
    weights: tuple[str, ...]  # names to map, each once, in order of first use
    logits: str | None = None  # the name the driver samples from (set on the last stage only)
    nodes: tuple[int, ...] = field(default=())  # node ids, for reports

    @property
    def executor_inputs(self) -> tuple[str, ...]:
        return tuple(self.graph.input_names) if self.graph is not None else ()

    @property
    def executor_outputs(self) -> tuple[str, ...]:
        return tuple(self.graph.outputs) if self.graph is not None else ()


def cut_stages(graph: Graph, bounds: list[tuple[int, int]], order: list[int] | None = None) -> list[StageGraph]:
    """The stages of ``graph`` cut at ``bounds`` (``[start, stop)`` positions in ``order``).

    ``order`` lists node ids in execution order (a plan's ``order``; default: the listed order).
    """
    by_id = {node.id: node for node in graph.nodes}
    order = [node.id for node in graph.nodes] if order is None else list(order)
    dropped = {node.id for node in graph.nodes if isinstance(node.op, Sample)}
    outputs, logits = driver_outputs(graph)
    kept: list[Node] = []
    pos_of_bound: dict[int, int] = {}  # plan position -> position among kept nodes
    for p, nid in enumerate(order):
        pos_of_bound[p] = len(kept)
        if nid not in dropped:
            kept.append(by_id[nid])
    pos_of_bound[len(order)] = len(kept)
    n = len(kept)

    index = Graph(kept, [], outputs, graph.weights).index  # the kept nodes, in plan order
    producer = {name: -1 for name in index.input_names}  # a graph input arrives before node 0
    producer.update(index.producer)
    last = dict(index.last_use)
    for name in outputs:
        if name not in producer:
            raise GraphValidationError(f"graph output {name!r} is produced by no node")
        last[name] = n
    names = sorted(producer, key=lambda t: (producer[t], t))  # deterministic message order
    born = np.array([producer[t] for t in names], dtype=np.int64)
    dies = np.array([last.get(t, producer[t]) for t in names], dtype=np.int64)

    def crossing(c: int) -> tuple[str, ...]:
        return tuple(tensors_crossing(names, born, dies, c))

    specs = infer_shapes(graph)
    stages = []
    for k, (start, stop) in enumerate(bounds):
        a, b = pos_of_bound[start], pos_of_bound[stop]
        receives, sends = crossing(a), crossing(b)
        nodes = kept[a:b]
        forwards = tuple(t for t in sends if t in receives)
        stages.append(StageGraph(
            index=k, graph=_stage_graph(nodes, sends, graph, specs) if nodes else None,
            receives=receives, sends=sends, forwards=forwards,
            weights=tuple(dict.fromkeys(w for node in nodes for w in node.inputs if w in graph.weights)),
            logits=logits if k == len(bounds) - 1 else None,
            nodes=tuple(node.id for node in nodes),
        ))
    return stages


def _stage_graph(nodes: list[Node], sends: tuple[str, ...], graph: Graph,
                 specs: dict[str, TensorSpec]) -> Graph:
    produced = {out for node in nodes for out in node.outputs}
    outputs = [t for t in sends if t in produced]
    weights = {w: graph.weights[w] for node in nodes for w in node.inputs if w in graph.weights}
    probe = Graph(list(nodes), [], outputs, weights)  # only to learn the input order
    inputs = [TensorSpec(specs[name].shape, specs[name].dtype) for name in probe.input_names]
    return Graph(list(nodes), inputs, outputs, weights)


def stage_bounds(plan) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in plan.stages]


def stages_for_plan(graph: Graph, plan) -> list[StageGraph]:
    """The stages of a :class:`partitioner.plan.Plan`, checked against what the plan says."""
    ids = [node.id for node in graph.nodes]
    if sorted(plan.order) != sorted(ids):
        raise GraphValidationError(
            f"the plan was made for another graph: it orders {len(plan.order)} nodes "
            f"(of {plan.model.get('name', 'another model')!r}), this model's graph has {len(ids)}; make one with "
            f"`dist-runtime partition MODEL -o PLAN.json`")
    stages = cut_stages(graph, stage_bounds(plan), plan.order)
    for st, ps in zip(stages, plan.stages):
        if set(st.weights) != set(ps.weights):
            raise GraphValidationError(
                f"stage {st.index}: the plan maps weights {sorted(ps.weights)[:4]}..., the cut "
                f"needs {sorted(st.weights)[:4]}...: was the plan made for another graph?")
    return stages
