"""Re-planning a running pipeline over other machines, and the record of each re-plan.

A pipeline is re-planned when a node is lost and no other node can take its stage (shrink), or
when an operator drains a node.  The new plan is the partitioner's exact one over the machines
that remain, each with the budget, reserve and speed the first plan gave it, for as many
sessions as fit: the first plan's, or fewer when the survivors cannot hold their KV caches (the
coordinator then sheds the newest sessions).  Every stage is deployed again on the remaining
nodes and every session is replayed onto it.

Each re-plan is kept as a :class:`Replan`: what triggered it, the old and new stages, and the
seconds of each phase (detect, plan, load, replay), shown by ``--stats``, ``--json``, the trace,
the timeline picture and /metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ..errors import InfeasiblePlanError

#: The phases of a re-plan, in order, as records and /metrics name them.
PHASES = ("detect", "plan", "load", "replay")


@dataclass(frozen=True)
class Replan:
    """One re-plan of a running pipeline."""

    trigger: str  # "node lost", "drain"
    cause: str  # what happened, in one line
    old: tuple[dict, ...]  # per stage: node, graph nodes, weight bytes (stage_summary)
    new: tuple[dict, ...]
    sessions: int | None  # the sessions the new plan holds the KV caches of (None: machines without budgets)
    at: float  # time.time() when it began
    seconds: dict = field(default_factory=dict)  # per phase (PHASES)
    shed: tuple[Hashable, ...] = ()  # sessions ended because the new plan holds fewer

    def describe(self) -> dict:
        """As ``--json`` and the trace record it."""
        return {"trigger": self.trigger, "cause": self.cause, "old": list(self.old), "new": list(self.new),
                "sessions": self.sessions, "at": self.at, "seconds": dict(self.seconds),
                "shed": [str(s) for s in self.shed]}

    def line(self) -> str:
        """One line for ``--stats`` and the log."""
        nodes = lambda stages: ", ".join(s["node"] for s in stages)  # noqa: E731
        phases = ", ".join(f"{p} {self.seconds[p]:.2f} s" for p in PHASES if p in self.seconds)
        shed = f"; shed {len(self.shed)} session(s): {', '.join(map(str, self.shed))}" if self.shed else ""
        return (f"re-plan ({self.trigger}: {self.cause}): {len(self.old)} stage(s) on [{nodes(self.old)}] -> "
                f"{len(self.new)} on [{nodes(self.new)}]; {phases}{shed}")


def stage_summary(plan, reports: list[dict]) -> tuple[dict, ...]:
    """Each stage of ``plan`` with the node it ran on (``reports``: the stages' load reports)."""
    out = []
    for stage, report in zip(plan.stages, reports):
        node = report.get("node_id") or report.get("host") or "?"
        span = "" if stage.empty else f"{stage.nodes[0]}..{stage.nodes[-1]}"
        out.append({"stage": stage.index, "node": node[:12], "graph_nodes": span,
                    "weight_bytes": stage.memory.weights, "kv_bytes": stage.memory.kv})
    return tuple(out)


def held_sessions(plan) -> int | None:
    """The sessions ``plan``'s machines hold the KV caches of: the sessions it was made for, or
    None (any number) when no machine has a budget."""
    machines = plan.request.get("machines") or []
    return plan.request["sessions"] if any(m.get("budget") is not None for m in machines) else None


def surviving_machines(plan, keep: list[int]):
    """The first plan's machines of the stages in ``keep``, in pipeline order: the budgets,
    reserves and speeds the user gave them."""
    from dist_runtime.partitioner.machines import Machine

    machines = plan.request.get("machines") or [{} for _ in plan.stages]
    return [Machine(budget=m.get("budget"), reserve=m.get("reserve") or 0, speed=m.get("speed") or 1,
                    name=m.get("name") or f"#{k}")
            for k, m in ((k, machines[k]) for k in keep)]


def joined_machine(plan, node_id: str):
    """A machine for a node that joined: its Ray memory as the budget when the first plan's
    machines had budgets (else none), speed 1."""
    import ray

    from dist_runtime.partitioner.machines import Machine

    budgeted = any(m.get("budget") is not None for m in plan.request.get("machines") or [])
    memory = next((n["Resources"].get("memory") for n in ray.nodes() if n["NodeID"] == node_id), None)
    return Machine(budget=int(memory) if budgeted and memory else None, name=node_id[:12])


def largest_plan(make: Callable[[int], object], most: int):
    """``make(sessions)`` for the most sessions in 1..``most`` it can plan (a binary search: KV
    grows with sessions, so feasibility is monotone).  Raises ``InfeasiblePlanError`` when not
    even one session fits."""
    try:
        return make(most)
    except InfeasiblePlanError as first:
        lo, hi, best = 1, most - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                best, lo = make(mid), mid + 1
            except InfeasiblePlanError:
                hi = mid - 1
        if best is None:
            raise first
        return best


class Stopwatch:
    """Seconds per named phase, each from the previous mark."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
