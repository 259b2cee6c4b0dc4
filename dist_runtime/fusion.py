"""Fusion pre-pass (being written): for now the identity."""

from .ir.graph import Graph


def fuse_graph(graph: Graph) -> Graph:
    return graph
