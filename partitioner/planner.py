"""From a graph and machines to a :class:`~partitioner.plan.Plan`: order, costs, solve, report.

``partition`` is the entry point the CLI and the Ray runtime use.  It also turns a memory failure
into the error a person can act on: when the budgets would fit the model at a shorter context,
it says which context (and how many sessions at the requested context) would fit.
"""

from __future__ import annotations

import time
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from dist_runtime.dtypes import kv_dtype as kv_dtype_of
from dist_runtime.errors import DistRuntimeError, InfeasiblePlanError
from dist_runtime.ir.graph import Graph, TensorSpec

from .costs import CostModel
from .graph_costs import graph_costs
from .granularity import coarsen, layer_boundaries
from .machines import GRANULARITIES, Machine
from .memory import IntervalMemory, prefix
from .plan import Plan, Stage, StageMemory
from .solver import Solution, feasible, infeasible, solve

_MEMORY_FAILURES = ("node_too_large", "total_too_large", "contiguity")


def solve_at(costs: CostModel, machines: Sequence[Machine], granularity: str = "auto",
             allow_empty: bool = False) -> tuple[Solution, str]:
    """Solve with cuts between layers (``layer``), anywhere (``node``), or between layers when
    the budgets allow it and anywhere otherwise (``auto``).  Returns the solution in node
    positions and the granularity used."""
    if granularity not in GRANULARITIES:
        raise DistRuntimeError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if granularity != "node":
        boundaries = layer_boundaries(costs)
        if boundaries is None and granularity == "layer":
            raise DistRuntimeError("granularity 'layer': no numbered layers (e.g. model.layers.3.) in the weight names")
        if boundaries is not None:
            coarse = coarsen(costs, boundaries)
            try:
                sol = solve(coarse, machines, allow_empty=allow_empty)
            except InfeasiblePlanError:
                if granularity == "layer":
                    raise
            else:
                bounds = tuple(int(coarse.starts[b]) for b in sol.bounds)
                return Solution(bounds, sol.bottleneck, sol.cut_bytes, sol.probes, sol.seconds), "layer"
    return solve(costs, machines, allow_empty=allow_empty), "node"


def partition(
    graph: Graph,
    machines: Sequence[Machine],
    *,
    max_context: int,
    sessions: int = 1,
    microbatches: int = 1,
    tokens: int | None = None,
    granularity: str = "auto",
    allow_empty: bool = False,
    weights: Mapping[str, TensorSpec] | None = None,
    model_name: str | None = None,
    kv_dtype: str | None = None,
) -> Plan:
    """Plan ``graph`` on ``machines`` (in order) for ``sessions`` in flight at ``max_context``, their
    KV caches kept in ``kv_dtype`` (``--kv-dtype``).

    Raises ``InfeasiblePlanError`` (``.kind`` says why) or ``GraphValidationError``.
    """
    started = time.perf_counter()
    kv_dtype = kv_dtype_of(kv_dtype).name.lower()  # the plan records the one it sized caches for
    options = dict(max_context=max_context, sessions=sessions, microbatches=microbatches,
                   tokens=tokens, weights=weights, kv_dtype=kv_dtype)
    costs = graph_costs(graph, **options)
    costed = time.perf_counter()
    try:
        solution, used = solve_at(costs, machines, granularity, allow_empty)
    except InfeasiblePlanError as err:
        raise _context_error(err, graph, machines, options, allow_empty) from None
    solved = time.perf_counter()
    request = {
        "max_context": max_context, "sessions": sessions, "microbatches": microbatches,
        "tokens": costs.meta["tokens"], "kv_dtype": kv_dtype, "granularity": granularity, "granularity_used": used,
        "allow_empty": allow_empty,
        "machines": [{"name": m.name, "budget": m.budget, "reserve": m.reserve, "speed": str(m.speed)}
                     for m in machines],
    }
    model = {"name": model_name or "", "nodes": len(graph.nodes), "outputs": list(graph.outputs)}
    plan = build_plan(costs, machines, solution, request=request, model=model, timings={
        "costs_seconds": costed - started, "seconds": solved - costed, "probes": solution.probes,
    })
    plan.solver["total_seconds"] = time.perf_counter() - started
    return plan


def build_plan(costs: CostModel, machines: Sequence[Machine], solution: Solution, *,
               request: dict | None = None, model: dict | None = None, timings: dict | None = None) -> Plan:
    """The :class:`Plan` of ``solution`` on the fine (node-level) ``costs``."""
    memory = IntervalMemory(costs)
    compute_prefix = prefix(costs.compute)
    total = int(compute_prefix[-1])
    ids = costs.node_ids if costs.node_ids is not None else np.arange(costs.n)
    stages = []
    for k, (m, a, b) in enumerate(zip(machines, solution.bounds, solution.bounds[1:])):
        work = int(compute_prefix[b] - compute_prefix[a])
        used = a < b
        stages.append(Stage(
            index=k, machine=m.name or f"m{k}", speed=str(m.speed), start=a, stop=b,
            nodes=tuple(ids[a:b].tolist()),
            weights=tuple(costs.stage_weights(a, b)),
            memory=StageMemory(
                weights=int(memory.weights(a, b)), kv=int(memory.kv(a, b)),
                activations=int(memory.activations(a, b)), reserve=m.reserve if m.budget is not None else 0,
                budget=m.budget,
            ),
            compute=work, time=float(Fraction(work) / m.speed), share=work / total if total else 0.0,
            bytes_in=int(costs.cut[a]) if used else 0, bytes_out=int(costs.cut[b]) if used else 0,
            tensors_in=tuple(costs.tensors.crossing(a)) if used and costs.tensors else (),
            tensors_out=tuple(costs.tensors.crossing(b)) if used and costs.tensors else (),
        ))
    speed = sum(Fraction(m.speed) for m in machines)
    return Plan(
        stages=tuple(stages), order=tuple(ids.tolist()), request=request or {},
        bottleneck=str(solution.bottleneck), ideal=str(Fraction(total) / speed),
        cut_bytes=solution.cut_bytes, total_compute=total, model=model or {}, solver=dict(timings or {}),
    )


def _context_error(err: InfeasiblePlanError, graph: Graph, machines: Sequence[Machine], options: dict,
                   allow_empty: bool) -> InfeasiblePlanError:
    """``err``, or, when a shorter context would fit, an error that says which."""
    if getattr(err, "kind", None) not in _MEMORY_FAILURES:
        return err
    context, sessions = options["max_context"], options["sessions"]

    def fits(ctx: int, sess: int) -> bool:
        tokens = None if options["tokens"] is None else min(options["tokens"], ctx)
        costs = graph_costs(graph, **{**options, "max_context": ctx, "sessions": sess, "tokens": tokens})
        return feasible(costs, machines, allow_empty)

    if context <= 1 or not fits(1, sessions):
        return err  # the weights themselves do not fit: the context is not the problem
    best_context = _largest(lambda c: fits(c, sessions), 1, context - 1)
    best_sessions = _largest(lambda s: fits(context, s), 1, sessions - 1) if sessions > 1 and fits(context, 1) else 0
    also = (f", or keep {context} tokens with at most {best_sessions} session{'s' * (best_sessions > 1)} "
            "in flight" if best_sessions else "")
    return infeasible(
        "context",
        f"the budgets are too small for a context of {context} tokens with {sessions} session"
        f"{'s' * (sessions > 1)} in flight ({err}). The largest context that fits is {best_context} "
        f"tokens (--max-context {best_context}){also}.",
        largest_context=best_context, largest_sessions=best_sessions or None, cause=getattr(err, "kind", None),
    )


def _largest(ok, lo: int, hi: int) -> int:
    """Largest x in [lo, hi] with ok(x), given ok(lo) and ok monotone decreasing."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
