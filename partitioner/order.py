"""The execution order the stages are cut from, and the acyclicity check, with networkx.

The seed's graphs list their nodes in topological order, and the executor runs them in that
order, so a plan keeps it whenever it is valid.  Checking that costs one pass over the edges with
numpy (every edge must point forward).  Building a ``networkx.DiGraph`` of a 100k-node graph
costs ~0.8 s on this kind of machine and ``is_directed_acyclic_graph`` another ~0.3 s
(docs/partitioning.md), so networkx is brought in when the listed order is *not* topological:
to find a cycle for the error message (``find_cycle``), or to compute the order that stays closest
to the listed one (``lexicographical_topological_sort`` keyed by listed position).
"""

from __future__ import annotations

import numpy as np

from dist_runtime.errors import GraphValidationError
from dist_runtime.ir.graph import Graph


def edges(graph: Graph) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Producer -> consumer positions, one edge per (tensor, consumer), with the tensor's name."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in node.outputs:
            producer.setdefault(name, i)
    src: list[int] = []
    dst: list[int] = []
    names: list[str] = []
    for i, node in enumerate(graph.nodes):
        for name in dict.fromkeys(node.inputs):
            p = producer.get(name)
            if p is not None:
                src.append(p)
                dst.append(i)
                names.append(name)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), names


def build_dag(graph: Graph):
    """A ``networkx.DiGraph``: one node per graph position, an edge per produced-then-consumed
    tensor, with the tensor names as the edge's ``tensors`` attribute."""
    import networkx as nx  # imported on demand: ~0.5 s of start-up the common path does not need

    src, dst, names = edges(graph)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.nodes)))
    for p, c, name in zip(src.tolist(), dst.tolist(), names):
        if dag.has_edge(p, c):
            dag[p][c]["tensors"].append(name)
        else:
            dag.add_edge(p, c, tensors=[name])
    return dag


def execution_order(graph: Graph) -> list[int]:
    """Positions of ``graph.nodes`` in the order to cut: the listed order if it is topological,
    else the topological order closest to it.  ``GraphValidationError`` names a cycle."""
    src, dst, _ = edges(graph)
    if not len(src) or bool(np.all(src < dst)):
        return list(range(len(graph.nodes)))
    import networkx as nx

    dag = build_dag(graph)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        steps = []
        for p, c in cycle:
            node = graph.nodes[p]
            steps.append(f"node {node.id} ({node.op_name}) -[{', '.join(dag[p][c]['tensors'])}]->")
        first = graph.nodes[cycle[0][0]]
        raise GraphValidationError(
            "the graph has a cycle, so no order of its nodes is a valid schedule: "
            + " ".join(steps) + f" node {first.id} ({first.op_name})"
        )
    return list(nx.lexicographical_topological_sort(dag, key=lambda pos: pos))
