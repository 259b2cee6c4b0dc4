"""Where cuts may go: anywhere between nodes, or only between layers.

Every system in the field cuts decoder models between layers (notes/partitioning.md); a cut inside
a layer gains little balance and splits a layer's weights and cache across machines.  Layers are
read from weight names (``model.layers.3.``, ``transformer.h.3.``, ``blocks.3.``...): a node
belongs to the layer of the weights it uses, nodes without weights are free, and a cut at
boundary ``c`` is allowed when the last node with weights before ``c`` and the first one at or
after ``c`` belong to different groups (a layer, or a non-layer weight such as the embedding,
the final norm or lm_head, each its own group).  The solver then picks the cheapest boundary
inside each gap, e.g. after a layer's residual add rather than before it.

Restricting cuts is exact by *coarsening*: the nodes between two allowed boundaries become one
unit whose compute and KV are sums, whose live activations are the maximum, and whose weights are
the union -- the memory of a run of units is then exactly the memory of the nodes they cover.
"""

from __future__ import annotations

import re

import numpy as np

from .costs import CostModel
from .memory import prefix

#: ``<stack>.<index>.`` at the start of a weight name's layer prefix (Hugging Face, GGUF ``blk.``).
_STACK = r"(.*?\b(?:layers|layer|h|blocks|block|blk)\.\d+)\."
LAYER = re.compile(_STACK)
_LAYER_START = re.compile(rf"^(?:{_STACK})?", re.MULTILINE)  # one (maybe empty) match per line


def layer_groups(names: list[str]) -> list[str]:
    """Each weight's group: its layer prefix (``model.layers.3``), else its own name.

    One ``findall`` over all names at once keeps the per-name matching in C (64k names: a few
    ms instead of ~150 ms for a match per name)."""
    text = "\n".join(names)
    if not names or text.count("\n") != len(names) - 1:  # a name with a newline: one by one
        return [(m.group(1) if (m := LAYER.match(name)) else name) for name in names]
    return [g or name for g, name in zip(_LAYER_START.findall(text), names)]


def layer_boundaries(costs: CostModel) -> np.ndarray | None:
    """Sorted allowed boundaries ``0 < c < n`` between layer groups, or None when the weights
    show no layer structure (fewer than two numbered layers)."""
    pos = costs.use_pos
    first = np.r_[True, pos[1:] != pos[:-1]]  # each node's first weight decides its group
    keyed, weight = pos[first], costs.use_weight[first]
    present = np.unique(weight)
    names = [costs.weight_names[w] for w in present.tolist()]
    groups = layer_groups(names)
    if len({g for g, name in zip(groups, names) if g != name}) < 2:
        return None
    ids = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    group_of = np.zeros(len(costs.weight_names), dtype=np.int64)
    group_of[present] = [ids[g] for g in groups]
    group = group_of[weight]
    change = np.flatnonzero(group[1:] != group[:-1])  # keyed[i] and keyed[i+1] differ
    allowed = [np.arange(keyed[i] + 1, keyed[i + 1] + 1) for i in change.tolist()]
    return np.concatenate(allowed) if allowed else np.zeros(0, dtype=np.int64)


def coarsen(costs: CostModel, boundaries: np.ndarray) -> CostModel:
    """The cost model whose units are the runs of nodes between allowed ``boundaries``."""
    n = costs.n
    starts = np.unique(np.r_[0, np.asarray(boundaries, dtype=np.int64), n])
    inner = starts[:-1]
    unit_of = np.searchsorted(starts, costs.use_pos, side="right") - 1
    width = max(len(costs.weight_names), 1)
    unit_pos, unit_weight = np.divmod(np.unique(unit_of * width + costs.use_weight), width)
    return CostModel(
        compute=np.diff(prefix(costs.compute)[starts]),
        kv=np.diff(prefix(costs.kv)[starts]),
        live=np.maximum.reduceat(costs.live, inner),
        cut=costs.cut[starts],
        weight_names=costs.weight_names,
        weight_bytes=costs.weight_bytes,
        use_pos=unit_pos,
        use_weight=unit_weight,
        node_ids=None if costs.node_ids is None else costs.node_ids[inner],
        ops=None if costs.ops is None else [costs.ops[i] for i in inner.tolist()],
        starts=starts,
        meta=costs.meta,
    )
