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

from .costs import CostModel, TensorUse
from .graph_costs import graph_costs
from .machines import Machine, make_machines
from .plan import Plan, Stage, StageMemory
from .planner import build_plan, partition, solve_at
from .solver import Solution, feasible, solve

__all__ = [
    "CostModel", "TensorUse", "graph_costs", "Machine", "make_machines", "Plan", "Stage",
    "StageMemory", "build_plan", "partition", "solve_at", "Solution", "feasible", "solve",
]
