"""The fusion pre-pass: recognised unfused patterns rewritten to the fused ops (tags 180-182).

``fuse_graph(graph, accepts=None)`` returns a new graph (the input is never mutated) in which
these groups of nodes are each replaced by one fused node, in this order:

1. **gate/up/SwiGlu** -> ``FusedSwiGlu(x, W_gate, W_up)``: ``gate = Matmul(x, W_gate)``,
   ``up = Matmul(x, W_up)`` (same ``x``, ``transpose_b``, 2-D weights) and ``SwiGlu(gate, up)``,
   or the spelled-out ``Mul(Silu(gate), up)`` (either operand order).  Placed where the SwiGlu
   (or Mul) was.
2. **add -> rmsnorm** -> ``FusedSkipNorm(a, b, w)`` with outputs ``(s, normed)``: ``s = Add(a,
   b)`` whose sum is also used elsewhere (the residual stream) or is a graph output, and
   ``normed = RmsNorm(s, w)``; ``a`` and ``b`` of one declared shape and dtype (the fused op does
   not broadcast).  Placed where the Add was.
3. **rmsnorm -> matmul** -> ``FusedNormMatmul(x, w, W)``: ``n = RmsNorm(x, w)`` whose every use
   is input 0 of a ``Matmul`` with ``transpose_b`` and a 2-D weight; one fused node per consumer,
   each recomputing the (cheap) norm, placed where its Matmul was.  Only when ``n`` has at most
   ``norm_matmul_max_consumers`` uses (default :data:`NORM_MATMUL_MAX_CONSUMERS` = 1): measured
   by ``benchmarks/bench_fusion.py``, recomputing the norm for the q/k/v projections of a layer
   costs more than the one dispatch it saves (see that file's docstring for the figures), so in
   a Llama graph this pattern fuses the final norm into ``lm_head``, and the attention norms are
   left to pattern 2.

Add -> RmsNorm is tried before RmsNorm -> Matmul because it removes a node without recomputing
anything; a norm taken by pattern 2 is not available to pattern 3.

**matmul -> silu**, the seed's third pattern, has no fused op of its own in the (fixed) tag
table: it is covered only inside pattern 1, where the Silu of the gate projection is part of
SwiGlu.  A lone ``Silu(Matmul(...))`` is left as it is, and so is the one-input SwiGlu of a fused
``gate_up_proj`` (Phi-3), which would need the weight split in two.

Rules every group obeys:

- every tensor that disappears (``gate``, ``up``, ``silu(gate)``, ``n``) has no consumer outside
  the group and is not a graph output; all other names keep their producer's name, so graph
  outputs, KV caches and liveness are unaffected;
- all nodes of a group have the same ``backend_hint`` (fusion never moves work across hints);
  the fused node carries it;
- the fused node takes the id of the group's first node (by position); when one norm feeds
  several fused matmuls, the first takes the norm's id and the others keep their Matmul's id, so
  ids stay unique and the result is deterministic;
- its ``attrs`` are the group's attrs merged (the first node's value wins), plus
  ``fused_from`` (the op names, e.g. ``"RmsNorm,Matmul"``) and ``fused_ids`` (the original ids);
- payload fields carry over (``eps`` from the RmsNorm);
- the fused op's shape rule must give exactly the specs the group produced, else nothing is
  fused (a safety net for broadcasting, dtypes, and ranks the checks above might miss);
- ``accepts(node, input_specs)`` (when given) must say that some backend takes the fused node,
  else the group is left unfused.  The executor builds it with :func:`backend_acceptor` from its
  backends.  A fused node that is already in the input graph and that ``accepts`` rejects is
  *expanded* back to its unfused ops (:func:`expand_fused_node`).

An input graph that does not validate is returned unchanged (copied), so that validation reports
the problem on the nodes the author wrote.  A caller that has validated the graph already passes
the specs ``validate_graph`` inferred, and fusion neither checks nor infers again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Collection, Iterable, Mapping, Sequence

from .backends import Backend
from .backends.assign import candidate_backends
from .errors import GraphValidationError
from .ir.builder import GraphBuilder
from .ir.graph import POS, Graph, Node, TensorSpec
from .ir.ops import Add, FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, Matmul, Mul, RmsNorm, Silu, SwiGlu
from .ir.validate import check_structure, infer_shapes

#: ``accepts(node, input_specs) -> bool``: does some backend take this (fused) node?
Accepts = Callable[[Node, Sequence[TensorSpec]], bool]

#: A RmsNorm feeding more Matmuls than this is not fused into them (see the module docstring).
NORM_MATMUL_MAX_CONSUMERS = 1

FUSED_OPS = (FusedNormMatmul, FusedSkipNorm, FusedSwiGlu)

#: The patterns, in the order they are tried (``fuse_graph(..., patterns=...)`` picks a subset).
PATTERNS = ("swiglu", "skip_norm", "norm_matmul")


# -- entry points ----------------------------------------------------------------------------------
def fuse_graph(graph: Graph, accepts: Accepts | None = None, *,
               norm_matmul_max_consumers: int = NORM_MATMUL_MAX_CONSUMERS,
               patterns: Collection[str] = PATTERNS,
               specs: Mapping[str, TensorSpec] | None = None) -> Graph:
    """A new graph with the recognised patterns fused (module docstring); ``graph`` is untouched.

    ``specs`` are ``graph``'s inferred specs if it is validated already (``validate_graph``).
    ``patterns`` (a subset of :data:`PATTERNS`, always applied in that order) and
    ``norm_matmul_max_consumers`` exist for measurements and tests; the defaults are the rule.
    """
    unknown = set(patterns) - set(PATTERNS)
    if unknown:
        raise ValueError(f"unknown fusion patterns {sorted(unknown)}; known: {list(PATTERNS)}")
    g = _copy(graph)
    if specs is None:
        try:
            check_structure(g)
            specs = infer_shapes(g)
        except GraphValidationError:
            return g
    if accepts is not None and any(isinstance(n.op, FUSED_OPS) for n in g.nodes):
        g = expand_rejected(g, accepts, specs)
        specs = infer_shapes(g)
    if "swiglu" in patterns:
        g = _fuse_swiglu(g, specs, accepts)
    if "skip_norm" in patterns:
        g = _fuse_skip_norm(g, specs, accepts)
    if "norm_matmul" in patterns:
        g = _fuse_norm_matmul(g, specs, accepts, norm_matmul_max_consumers)
    return g


def backend_acceptor(backends: Sequence[Backend]) -> Accepts:
    """``accepts`` for :func:`fuse_graph` from an executor's backends (CPU library last): true when
    one of the node's candidates -- the backends ``assign_backends`` would try, from
    :func:`~dist_runtime.backends.assign.candidate_backends` -- supports it with these input specs."""
    def accepts(node: Node, input_specs: Sequence[TensorSpec]) -> bool:
        return any(c.takes(node, list(input_specs)) for c in candidate_backends(node, backends))

    return accepts


def expand_rejected(graph: Graph, accepts: Accepts, specs: Mapping[str, TensorSpec] | None = None) -> Graph:
    """A new graph in which every fused node that ``accepts`` rejects is replaced by its unfused ops."""
    specs = infer_shapes(graph) if specs is None else specs
    b = GraphBuilder(next_id=max((n.id for n in graph.nodes), default=-1) + 1, taken=_all_names(graph))
    for node in graph.nodes:
        if isinstance(node.op, FUSED_OPS) and not accepts(node, [specs[n] for n in node.inputs]):
            expand_fused_node(node, b)
        else:
            b.nodes.append(node)
    return Graph(b.nodes, list(graph.inputs), list(graph.outputs), dict(graph.weights))


def expand_fused_node(node: Node, b: GraphBuilder) -> None:
    """Append to ``b`` the unfused nodes computing ``node`` (a FusedNormMatmul, FusedSkipNorm or
    FusedSwiGlu).  The first keeps ``node.id``, the others take the builder's next ids; new
    intermediate names are ``<output>.normed`` / ``.gate`` / ``.up``, suffixed until unused.
    Attrs and the backend hint carry over, plus ``expanded_from``."""
    attrs = {**node.attrs, "expanded_from": node.op_name}
    first = iter([node.id])

    def new(op, inputs, outputs) -> None:
        b.emit(op, inputs, outputs, attrs=attrs, backend_hint=node.backend_hint, node_id=next(first, None))

    op, ins, outs = node.op, node.inputs, node.outputs
    if isinstance(op, FusedNormMatmul):
        x, norm_w, w = ins
        normed = b.fresh(f"{outs[0]}.normed")
        new(RmsNorm(eps=op.eps), [x, norm_w], normed)
        new(Matmul(), [normed, w], outs)
    elif isinstance(op, FusedSkipNorm):
        x, residual, w = ins
        new(Add(), [x, residual], outs[0])
        new(RmsNorm(eps=op.eps), [outs[0], w], outs[1])
    elif isinstance(op, FusedSwiGlu):
        x, w_gate, w_up = ins
        gate, up = b.fresh(f"{outs[0]}.gate"), b.fresh(f"{outs[0]}.up")
        new(Matmul(), [x, w_gate], gate)
        new(Matmul(), [x, w_up], up)
        new(SwiGlu(), [gate, up], outs)
    else:
        raise ValueError(f"node {node.id} ({node.op_name}) is not a fused op")


# -- the passes ------------------------------------------------------------------------------------
class _Pass:
    """One rewrite over a graph: groups claimed so far, and the facts the pattern checks need."""

    def __init__(self, graph: Graph, specs: Mapping[str, TensorSpec], accepts: Accepts | None) -> None:
        self.graph, self.specs, self.accepts = graph, specs, accepts
        self.nodes = graph.nodes
        self.producer = graph.index.producer
        self.consumers = graph.index.consumers
        self.outputs = set(graph.outputs)
        self.claimed: set[int] = set()  # positions of nodes in an accepted group
        self.placed: dict[int, list[Node]] = {}  # position -> fused nodes emitted there

    def produced_by(self, name: str, op_class: type) -> int | None:
        """Position of the unclaimed node of ``op_class`` producing ``name``, or None."""
        i = self.producer.get(name)
        if i is None or i in self.claimed or not isinstance(self.nodes[i].op, op_class):
            return None
        return i

    def only_use(self, name: str, position: int) -> bool:
        """``name`` vanishes safely into the node at ``position``: its only use, not an output."""
        return name not in self.outputs and self.consumers.get(name, []) == [position]

    def available_at(self, name: str, position: int) -> bool:
        """Can a node at ``position`` read ``name``?"""
        i = self.producer.get(name)
        return i is None and (name in self.graph.weights or name == POS or name in self.graph.input_names) \
            or i is not None and i < position

    def linear_weight(self, position: int) -> bool:
        """The node at ``position`` is ``Matmul(a, W)`` with ``transpose_b`` and a 2-D ``W``."""
        node = self.nodes[position]
        return (isinstance(node.op, Matmul) and node.op.transpose_b and node.inputs[0] != node.inputs[1]
                and len(self.specs[node.inputs[1]].shape) == 2)

    def candidate(self, op, group: Sequence[int], inputs: list[str], outputs: list[str],
                  node_id: int | None = None) -> Node | None:
        """The fused node replacing the nodes at ``group`` positions, or None if it must not be:
        hints differ, the shape rule disagrees with the group's specs, or no backend accepts it."""
        members = [self.nodes[i] for i in sorted(group)]
        hints = {n.backend_hint for n in members}
        if len(hints) != 1 or any(i in self.claimed for i in group):
            return None
        attrs: dict = {}
        for n in members:
            for k, v in n.attrs.items():
                attrs.setdefault(k, v)
        attrs["fused_from"] = ",".join(n.op_name for n in members)
        attrs["fused_ids"] = tuple(n.id for n in members)
        node = Node(members[0].id if node_id is None else node_id, op, inputs, outputs, attrs, hints.pop())
        in_specs = [self.specs[n] for n in inputs]
        try:
            got = op.spec.shape(op, in_specs)
        except GraphValidationError:
            return None
        if [(s.shape, s.dtype) for s in got] != [(self.specs[n].shape, self.specs[n].dtype) for n in outputs]:
            return None
        if self.accepts is not None and not self.accepts(node, in_specs):
            return None
        return node

    def claim(self, group: Iterable[int], placed: Iterable[tuple[int, Node]]) -> None:
        self.claimed.update(group)
        for position, node in placed:
            self.placed.setdefault(position, []).append(node)

    def result(self) -> Graph:
        nodes: list[Node] = []
        for i, node in enumerate(self.nodes):
            nodes.extend(self.placed.get(i, []))
            if i not in self.claimed:
                nodes.append(node)
        g = self.graph
        return Graph(nodes, list(g.inputs), list(g.outputs), dict(g.weights))


def _fuse_swiglu(graph: Graph, specs, accepts) -> Graph:
    p = _Pass(graph, specs, accepts)
    for k, node in enumerate(p.nodes):
        if isinstance(node.op, SwiGlu) and len(node.inputs) == 2:
            forms = [(node.inputs[0], node.inputs[1], [k])]
        elif isinstance(node.op, Mul):  # Mul(Silu(gate), up), either operand order
            forms = []
            for s, up in (node.inputs, node.inputs[::-1]):
                j = p.produced_by(s, Silu)
                if j is not None and s != up and p.only_use(s, k):
                    forms.append((p.nodes[j].inputs[0], up, [j, k]))
        else:
            continue
        for gate, up, tail in forms:
            ig, iu = p.produced_by(gate, Matmul), p.produced_by(up, Matmul)
            if ig is None or iu is None or gate == up:
                continue
            if not (p.only_use(gate, tail[0]) and p.only_use(up, k)):
                continue
            if not (p.linear_weight(ig) and p.linear_weight(iu)):
                continue
            x = p.nodes[ig].inputs[0]
            if p.nodes[iu].inputs[0] != x:
                continue
            group = [ig, iu, *tail]
            fused = p.candidate(FusedSwiGlu(), group, [x, p.nodes[ig].inputs[1], p.nodes[iu].inputs[1]],
                                list(node.outputs))
            if fused is not None:
                p.claim(group, [(k, fused)])
                break
    return p.result()


def _fuse_skip_norm(graph: Graph, specs, accepts) -> Graph:
    p = _Pass(graph, specs, accepts)
    for j, node in enumerate(p.nodes):
        if not isinstance(node.op, RmsNorm):
            continue
        s, w = node.inputs
        i = p.produced_by(s, Add)
        if i is None or s == w:
            continue
        a, b = p.nodes[i].inputs
        if len(p.consumers.get(s, [])) < 2 and s not in p.outputs:
            continue  # the sum is not needed beyond the norm: pattern 3 may take the norm instead
        if (specs[a].shape, specs[a].dtype) != (specs[b].shape, specs[b].dtype) or not p.available_at(w, i):
            continue
        fused = p.candidate(FusedSkipNorm(eps=node.op.eps), [i, j], [a, b, w], [s, node.outputs[0]])
        if fused is not None:
            p.claim([i, j], [(i, fused)])
    return p.result()


def _fuse_norm_matmul(graph: Graph, specs, accepts, max_consumers: int) -> Graph:
    p = _Pass(graph, specs, accepts)
    for i, node in enumerate(p.nodes):
        if not isinstance(node.op, RmsNorm):
            continue
        n = node.outputs[0]
        readers = p.consumers.get(n, [])
        if n in p.outputs or not 1 <= len(readers) <= max_consumers:
            continue
        # linear_weight also rules out Matmul(n, n): the norm must feed input 0 only
        if any(p.nodes[j].inputs[0] != n or not p.linear_weight(j) or j in p.claimed for j in readers):
            continue
        x, norm_w = node.inputs
        fused_nodes = []
        for k, j in enumerate(readers):
            mm = p.nodes[j]
            fused = p.candidate(FusedNormMatmul(eps=node.op.eps), [i, j], [x, norm_w, mm.inputs[1]],
                                list(mm.outputs), node_id=node.id if k == 0 else mm.id)
            if fused is None:
                break  # all or nothing: a norm kept for one consumer saves nothing for the others
            fused_nodes.append((j, fused))
        else:
            p.claim([i, *readers], fused_nodes)
    return p.result()


# -- helpers ---------------------------------------------------------------------------------------
def _copy(graph: Graph) -> Graph:
    """A graph sharing nothing mutable with ``graph`` (nodes, lists, dicts)."""
    nodes = [replace(n, inputs=list(n.inputs), outputs=list(n.outputs), attrs=dict(n.attrs)) for n in graph.nodes]
    return Graph(nodes, list(graph.inputs), list(graph.outputs), dict(graph.weights))


def _all_names(graph: Graph) -> set[str]:
    names = {*graph.weights, *graph.outputs, POS}
    for n in graph.nodes:
        names.update(n.inputs)
        names.update(n.outputs)
    return names
