"""Exact, memory-budgeted, heterogeneous pipeline-stage planning (docs/partitioning.md).

``partition(graph, machines, max_context=..., sessions=...)`` returns a :class:`Plan`; the pieces:

* ``machines``  -- :class:`Machine` (budget, reserve, relative speed) and the CLI's vocabulary;
* ``order``     -- the execution order and the acyclicity check (networkx);
* ``graph_costs`` / ``flops`` -- the cost model of a graph: weights, KV, activations, FLOPs, cuts;
* ``costs``     -- :class:`CostModel`, the arrays the solver works on (buildable by hand);
* ``memory``    -- memory of any interval in O(1)-ish (prefix sums, sparse table, merge-sort tree);
* ``solver``    -- the exact chains-on-chains solver and its error messages;
* ``granularity`` -- cuts between layers by coarsening;
* ``plan`` / ``svg`` / ``cli`` -- the plan object, its drawing and the ``partition`` command.
"""

from dist_runtime import _lazy_exports

# Lazy, so that ``dist-runtime --help`` (which builds the ``partition`` parser) imports no numpy.
_LAZY = {
    "CostModel": ("dist_runtime.partitioner.costs", "CostModel"),
    "TensorUse": ("dist_runtime.partitioner.costs", "TensorUse"),
    "graph_costs": ("dist_runtime.partitioner.graph_costs", "graph_costs"),
    "Machine": ("dist_runtime.partitioner.machines", "Machine"),
    "make_machines": ("dist_runtime.partitioner.machines", "make_machines"),
    "Plan": ("dist_runtime.partitioner.plan", "Plan"),
    "Stage": ("dist_runtime.partitioner.plan", "Stage"),
    "StageMemory": ("dist_runtime.partitioner.plan", "StageMemory"),
    "build_plan": ("dist_runtime.partitioner.planner", "build_plan"),
    "partition": ("dist_runtime.partitioner.planner", "partition"),
    "solve_at": ("dist_runtime.partitioner.planner", "solve_at"),
    "Solution": ("dist_runtime.partitioner.solver", "Solution"),
    "feasible": ("dist_runtime.partitioner.solver", "feasible"),
    "solve": ("dist_runtime.partitioner.solver", "solve"),
}

__all__ = list(_LAZY)

__getattr__ = _lazy_exports(__name__, _LAZY)
