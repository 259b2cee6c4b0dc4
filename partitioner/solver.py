"""The exact solver: contiguous stages on machines in a fixed order (chains-on-chains).

Objective, lexicographic: (1) the smallest bottleneck ``T* = max_k compute_k / speed_k`` such that
every stage fits its machine's capacity; (2) among plans with bottleneck ``T*``, the fewest bytes
across cuts; (3) among those, the lexicographically smallest list of stage boundaries.

How (docs/partitioning.md has the proofs):

* **Reach probe.**  For a bound ``B``, the set of boundary positions reachable after ``k`` stages
  is a union of intervals.  For a start ``a`` that can hold a node, the stage can end anywhere in
  ``(a, far_k(a)]``, where ``far_k(a)`` is the largest end with compute and memory within bounds
  (both monotone, so a prefix sum search plus a memory binary search find it), and ``far_k`` is
  non-decreasing in ``a``.  So a run of usable starts ``[u, v]`` reaches exactly ``[u+1, far(v)]``:
  one farthest-reach query per run, an exact greedy.  ``B`` is feasible iff ``n`` is reachable after
  the last stage.
* **Exact bisection.**  The probe's answer only changes where ``B`` crosses a value
  ``compute(a, b) / speed_k``.  An infeasible probe reports the smallest such value above ``B``
  that any of its decisions depended on (the *next event*): every bound below it fails the same
  way, so it is a lower bound that is itself a candidate.  Bisection on exact fractions between
  that lower bound and a feasible upper bound ends with ``T*`` exactly.
* **Fewest cut bytes.**  With ``T*`` fixed, a backward dynamic program over the reachable
  boundaries, ``E_k(a) = cut(a) + min over b in (a, far_k(a)] of E_{k+1}(b)``, uses a sparse-table
  range minimum per stage; walking forward and taking the smallest optimal ``b`` each time gives
  the lexicographically smallest optimal plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

from dist_runtime.errors import DistRuntimeError, InfeasiblePlanError
from dist_runtime.units import format_bytes

from .costs import CostModel
from .machines import Machine
from .memory import IntervalMemory, SparseTable, prefix

#: Stand-in for "no limit" and "unreachable": far above any real byte count, far below overflow.
INF = 1 << 62

Intervals = list[tuple[int, int]]  # sorted, disjoint, inclusive [lo, hi] ranges of positions


@dataclass(frozen=True)
class Solution:
    """Stage ``k`` covers positions ``bounds[k]:bounds[k + 1]``."""

    bounds: tuple[int, ...]
    bottleneck: Fraction  # max over stages of compute / speed
    cut_bytes: int  # bytes crossing the internal boundaries
    probes: int
    seconds: float


def infeasible(kind: str, message: str, **details) -> InfeasiblePlanError:
    """An ``InfeasiblePlanError`` with a machine-readable ``kind`` and ``details``."""
    return InfeasiblePlanError(message, kind, details)


@dataclass
class _Probe:
    feasible: bool
    reach: list[Intervals]  # reach[k]: boundaries reachable after k stages
    event: Fraction | None  # smallest bound above the probed one that could change the answer


def _merge(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for lo, hi in sorted(i for i in intervals if i[0] <= i[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _positions(intervals: Intervals) -> np.ndarray:
    if not intervals:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(lo, hi + 1, dtype=np.int64) for lo, hi in intervals])


def _earliest(a: Fraction | None, b: Fraction | None) -> Fraction | None:
    return b if a is None else a if b is None else min(a, b)


class _Solver:
    def __init__(self, costs: CostModel, machines: Sequence[Machine], allow_empty: bool) -> None:
        self.costs, self.machines, self.allow_empty = costs, list(machines), allow_empty
        self.n, self.S = costs.n, len(machines)
        self.compute = costs.compute
        self.compute_prefix = prefix(costs.compute)
        if self.compute_prefix[-1] >= INF:
            raise DistRuntimeError("the total compute overflows 62 bits; scale the compute units down")
        self.memory = IntervalMemory(costs)
        positions = np.arange(self.n, dtype=np.int64)
        self.single = self.memory.total(positions, positions + 1)  # each node alone
        # Integer speeds (exact comparisons): stage time compute/speed <= B  <=>  compute <= B * s.
        scale = math.lcm(*(m.speed.denominator for m in machines))
        self.speeds = [int(m.speed * scale) for m in machines]
        self.scale = scale
        self.caps = [INF if m.capacity is None else m.capacity for m in machines]
        # Per distinct capacity: prefix count of nodes too big to stand alone (O(1) run checks).
        self._too_big = {cap: prefix((self.single > cap).astype(np.int64)) for cap in set(self.caps)}
        self._max_compute = SparseTable(self.compute)
        self._limits: dict[tuple[int, int], int] = {}  # (capacity, start) -> memory-bound end
        self.probes = 0

    # -- the reach probe -------------------------------------------------------------------------
    def allowance(self, bound: Fraction | None, k: int) -> int | None:
        """Largest compute stage ``k`` may take under ``bound`` (None: unlimited)."""
        if bound is None:
            return None
        return min((bound.numerator * self.speeds[k]) // bound.denominator, INF)

    def usable(self, starts: np.ndarray, k: int, allow: int | None) -> np.ndarray:
        """Which start positions can hold at least their own node on machine ``k``."""
        ok = self.single[starts] <= self.caps[k]
        if allow is not None:
            ok &= self.compute[starts] <= allow
        return ok

    def runs(self, lo: int, hi: int, k: int, allow: int | None) -> tuple[Intervals, Fraction | None]:
        """Maximal runs of usable starts in ``[lo, hi]``, and the next event among the starts that
        only the compute bound excludes."""
        if lo > hi:
            return [], None
        cap_bad = self._too_big[self.caps[k]]
        no_big = cap_bad[hi + 1] == cap_bad[lo]
        if no_big and (allow is None or self._max_compute.query_one(lo, hi + 1) <= allow):
            return [(lo, hi)], None  # the common case, in O(1)
        starts = np.arange(lo, hi + 1, dtype=np.int64)
        ok = self.usable(starts, k, allow)
        event = None
        if allow is not None:
            slow = (self.compute[starts] > allow) & (self.single[starts] <= self.caps[k])
            if slow.any():
                event = Fraction(int(self.compute[starts][slow].min()), self.speeds[k])
        good = starts[ok]
        if not len(good):
            return [], event
        breaks = np.flatnonzero(np.diff(good) > 1)
        firsts = good[np.r_[0, breaks + 1]].tolist()
        lasts = good[np.r_[breaks, len(good) - 1]].tolist()
        return list(zip(firsts, lasts)), event

    def farthest(self, starts: np.ndarray, k: int, allow: int | None) -> tuple[np.ndarray, Fraction | None]:
        """``far_k(a)`` for usable starts: the largest stage end within both bounds; and the next
        event (the smallest bound at which some compute-limited end would move)."""
        if len(starts) == 1:
            far, event = self._farthest_one(int(starts[0]), k, allow)
            return np.array([far], dtype=np.int64), event
        n, cap = self.n, self.caps[k]
        if allow is None:
            far_c = np.full(len(starts), n, dtype=np.int64)
        else:
            limit = np.minimum(self.compute_prefix[starts] + allow, INF)
            far_c = np.searchsorted(self.compute_prefix, limit, side="right") - 1
        fits = self.memory.total(starts, far_c) <= cap
        far = far_c.copy()
        if not fits.all():
            far[~fits] = self._memory_limit(starts[~fits], far_c[~fits], cap)
        event = None
        moving = fits & (far_c < n)
        if allow is not None and moving.any():
            more = self.compute_prefix[far_c[moving] + 1] - self.compute_prefix[starts[moving]]
            event = Fraction(int(more.min()), self.speeds[k])
        return far, event

    def _farthest_one(self, a: int, k: int, allow: int | None) -> tuple[int, Fraction | None]:
        """``farthest`` for one start, with Python integers; memory limits are cached, since they
        do not depend on the bound and the probe meets the same starts again."""
        n, cap, cp = self.n, self.caps[k], self.compute_prefix
        far_c = n if allow is None else int(cp.searchsorted(min(int(cp[a]) + allow, INF), side="right")) - 1
        limit = self._limits.get((cap, a))
        if limit is None and self.memory.total_one(a, far_c) > cap:
            lo, hi = a + 1, far_c  # memory(a, lo) fits, memory(a, hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.memory.total_one(a, mid) <= cap else (lo, mid)
            limit = self._limits[cap, a] = lo
        if limit is not None and limit < far_c:
            return limit, None  # memory-bound: a larger time bound changes nothing
        event = None
        if allow is not None and far_c < n:
            event = Fraction(int(cp[far_c + 1] - cp[a]), self.speeds[k])
        return far_c, event

    def _memory_limit(self, lo: np.ndarray, hi: np.ndarray, cap: int) -> np.ndarray:
        """Largest ``b`` with memory(a, b) <= cap, given that ``a + 1`` fits and ``hi`` does not."""
        a = lo.copy()
        lo, hi = lo + 1, hi.copy()
        while True:
            open_ = hi - lo > 1
            if not open_.any():
                return lo
            mid = (lo + hi) // 2
            fit = self.memory.total(a, mid) <= cap
            lo = np.where(open_ & fit, mid, lo)
            hi = np.where(open_ & ~fit, mid, hi)

    def probe(self, bound: Fraction | None) -> _Probe:
        """Reachable boundaries after each stage under ``bound`` (None: memory only)."""
        self.probes += 1
        n, S = self.n, self.S
        reach: list[Intervals] = [[(0, 0)]]
        event = None
        for k in range(S):
            allow = self.allowance(bound, k)
            # Without empty stages, each later stage needs a node of its own.
            ceiling = n if self.allow_empty else n - (S - 1 - k)
            found: Intervals = []
            for lo, hi in reach[-1]:
                runs, ev = self.runs(lo, min(hi, n - 1), k, allow)
                event = _earliest(event, ev)
                if not runs:
                    continue
                far, ev = self.farthest(np.array([v for _, v in runs], dtype=np.int64), k, allow)
                event = _earliest(event, ev)
                found += [(u + 1, min(int(f), ceiling)) for (u, _), f in zip(runs, far)]
            if self.allow_empty:
                found += reach[-1]
            reach.append(_merge(found))
            if not reach[-1]:
                break
        feasible = len(reach) == S + 1 and bool(reach[-1]) and reach[-1][-1][1] == n
        return _Probe(feasible, reach, event)

    # -- objective 1: the bottleneck -------------------------------------------------------------
    def bottleneck(self) -> tuple[Fraction, _Probe]:
        """The exact optimal bound (in compute per integer speed unit) and its probe."""
        total = int(self.compute_prefix[-1])
        upper = Fraction(total, min(self.speeds))  # everything fits one stage's time budget
        lower = max(Fraction(total, sum(self.speeds)), Fraction(int(self.compute.max(initial=0)), max(self.speeds)))
        probed = None  # the last lower bound probed (a lower bound not yet probed may be T*)
        best: tuple[Fraction, _Probe] | None = None  # the last feasible probe
        while lower < upper:
            if probed != lower:
                r = self.probe(lower)
                if r.feasible:
                    return lower, r
                probed, lower = lower, r.event  # every bound below the event fails the same way
                if lower is None or lower >= upper:
                    break
            mid = (lower + upper) / 2
            r = self.probe(mid)
            if r.feasible:
                upper, best = mid, (mid, r)
            else:
                lower = r.event
                if lower is None:  # cannot happen: the upper bound is feasible
                    raise AssertionError("infeasible probe below a feasible bound without an event")
        # lower >= upper, and lower <= T* <= upper: they meet at T*.
        r = best[1] if best is not None and best[0] == upper else self.probe(upper)
        assert r.feasible
        return upper, r

    # -- objective 2 and 3: fewest cut bytes, then the smallest boundaries -----------------------
    def fewest_cut_bytes(self, bound: Fraction, reach: list[Intervals]) -> tuple[tuple[int, ...], int]:
        n, S = self.n, self.S
        charge = self.costs.cut.copy()
        charge[0] = charge[n] = 0  # the graph's inputs and outputs are not cuts
        best = [np.full(n + 1, INF, dtype=np.int64) for _ in range(S + 1)]
        best[S][n] = 0
        for k in reversed(range(S)):
            after = SparseTable(best[k + 1], op=np.minimum, empty=INF)
            allow = self.allowance(bound, k)
            here = _positions(reach[k])
            starts = here[here < n]
            starts = starts[self.usable(starts, k, allow)]
            if len(starts):
                far, _ = self.farthest(starts, k, allow)
                best[k][starts] = np.minimum(charge[starts] + after.query(starts + 1, far + 1), INF)
            if self.allow_empty:
                best[k][here] = np.minimum(best[k][here], best[k + 1][here])
        if best[0][0] >= INF:
            raise AssertionError("no plan at the optimal bottleneck")
        bounds, a = [0], 0
        for k in range(S):
            target = best[k][a]
            if self.allow_empty and best[k + 1][a] == target:
                b = a  # an empty stage is the smallest possible next boundary
            else:
                (far,), _ = self.farthest(np.array([a], dtype=np.int64), k, self.allowance(bound, k))
                ends = best[k + 1][a + 1 : far + 1]
                b = a + 1 + int(np.flatnonzero(ends == target - charge[a])[0])
            bounds.append(b)
            a = b
        return tuple(bounds), int(best[0][0])

    # -- why nothing fits ------------------------------------------------------------------------
    def explain(self, top: _Probe) -> InfeasiblePlanError:
        """The most actionable reason why even unlimited time leaves no plan."""
        costs, n = self.costs, self.n
        caps = [c for c in self.caps]
        widest = max(range(self.S), key=lambda k: (caps[k], -k))
        biggest = int(np.argmax(self.single))
        if self.single[biggest] > caps[widest]:
            need = self._breakdown(biggest, biggest + 1)
            uses = costs.stage_weights(biggest, biggest + 1)
            using = f" using {', '.join(uses[:3])}{'...' if len(uses) > 3 else ''}" if uses else ""
            return infeasible(
                "node_too_large",
                f"{costs.label(biggest)}{using} needs {format_bytes(need['total'])} ({need['total']:,} bytes: "
                f"{self._parts(need)}), more than the largest budget, {format_bytes(caps[widest])} "
                f"({caps[widest]:,} bytes) on machine {self.machines[widest].describe(widest)}; no stage "
                "can hold it: add memory, quantize its weights, or lower the context or sessions",
                node=biggest, bytes=int(self.single[biggest]), largest_budget=caps[widest],
            )
        whole = self._breakdown(0, n)
        room = sum(caps)
        if whole["total"] > room:
            return infeasible(
                "total_too_large",
                f"the model needs {format_bytes(whole['total'])} ({self._parts(whole)}) but the "
                f"{self.S} budgets add up to {format_bytes(room)}: add machines or memory, or lower "
                "the context or sessions",
                total=whole["total"], budgets=room,
            )
        covered = max(hi for level in top.reach for _, hi in level)
        stuck = min(covered, n - 1)
        return infeasible(
            "contiguity",
            f"the model's {format_bytes(whole['total'])} fits the budgets' sum "
            f"{format_bytes(room)}, but no split into {self.S} contiguous stages does, in this "
            f"machine order: the stages can cover at best nodes 0..{covered - 1} of {n}, and "
            f"{costs.label(stuck)} ({format_bytes(int(self.single[stuck]))}) does not fit after them. "
            "Reorder the machines, add one, or raise the budgets",
            covered=covered, total=whole["total"], budgets=room,
        )

    def _breakdown(self, a: int, b: int) -> dict[str, int]:
        m = self.memory
        parts = {"weights": int(m.weights(a, b)), "kv": int(m.kv(a, b)), "activations": int(m.activations(a, b))}
        parts["total"] = sum(parts.values())
        return parts

    @staticmethod
    def _parts(p: dict[str, int]) -> str:
        return (f"weights {format_bytes(p['weights'])}, KV cache {format_bytes(p['kv'])}, "
                f"activations {format_bytes(p['activations'])}")


def check_request(costs: CostModel, machines: Sequence[Machine], allow_empty: bool) -> None:
    if not machines:
        raise infeasible("no_machines", "no machines: give --stages N or --budgets")
    if costs.n == 0:
        raise infeasible("empty_graph", "the graph has no nodes to place")
    if len(machines) > costs.n and not allow_empty:
        unit = "units (layer boundaries)" if costs.starts is not None else "nodes"
        raise infeasible(
            "more_stages_than_nodes",
            f"{len(machines)} stages were requested but there are only {costs.n} {unit} to place: "
            f"ask for at most {costs.n} stages (or let machines stay empty: `dist-runtime partition --allow-empty`)",
            stages=len(machines), nodes=costs.n,
        )


def feasible(costs: CostModel, machines: Sequence[Machine], allow_empty: bool = False) -> bool:
    """Whether any plan fits the budgets (time unlimited)."""
    try:
        check_request(costs, machines, allow_empty)
    except InfeasiblePlanError:
        return False
    return _Solver(costs, machines, allow_empty).probe(None).feasible


def solve(costs: CostModel, machines: Sequence[Machine], *, allow_empty: bool = False) -> Solution:
    """The optimal plan for ``costs`` on ``machines`` (in order), or ``InfeasiblePlanError``."""
    started = time.perf_counter()
    check_request(costs, machines, allow_empty)
    solver = _Solver(costs, machines, allow_empty)
    top = solver.probe(None)
    if not top.feasible:
        raise solver.explain(top)
    bound, probe = solver.bottleneck()
    bounds, cut_bytes = solver.fewest_cut_bytes(bound, probe.reach)
    # Report the bottleneck in real time units: compute / speed, speed = integer speed / scale.
    times = [
        Fraction(int(solver.compute_prefix[b] - solver.compute_prefix[a]) * solver.scale, s)
        for a, b, s in zip(bounds, bounds[1:], solver.speeds)
    ]
    worst = max(times)
    assert worst == bound * solver.scale, (worst, bound * solver.scale)
    return Solution(bounds, worst, cut_bytes, solver.probes, time.perf_counter() - started)
