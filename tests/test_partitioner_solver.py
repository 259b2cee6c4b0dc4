"""The exact solver on synthetic cost models: the cases of shared/notes/partitioning.md, and
optimality against independent oracles (brute force and the O(S n^2) dynamic program) on
hundreds of random small instances.

The oracles below recompute memory, time and cut bytes from the raw instance (node weights,
tensor lifetimes) with plain loops: they share no code with the solver's prefix sums, sparse
tables and merge-sort tree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_runtime.errors import InfeasiblePlanError
from dist_runtime.partitioner.costs import CostModel, TensorUse
from dist_runtime.partitioner.machines import Machine
from dist_runtime.partitioner.memory import IntervalMemory
from dist_runtime.partitioner.solver import feasible, solve


# -- a raw instance and its independent oracles --------------------------------------------------
@dataclass
class Instance:
    compute: list[int]
    kv: list[int]
    weights: list[list[str]]
    weight_bytes: dict[str, int]
    tensors: list[TensorUse]

    @property
    def n(self) -> int:
        return len(self.compute)

    def costs(self) -> CostModel:
        return CostModel.from_parts(self.compute, kv=self.kv, weights=self.weights,
                                    weight_bytes=self.weight_bytes, tensors=self.tensors)

    def live_at(self, i: int) -> int:
        """Activation bytes held while node i runs, by scanning every tensor."""
        return sum(t.size if t.act is None else t.act for t in self.tensors
                   if max(t.producer, 0) <= i <= min(max(t.last, t.producer), self.n - 1))

    def memory(self, a: int, b: int) -> int:
        if a >= b:
            return 0
        if not hasattr(self, "_live"):
            self._live = [self.live_at(i) for i in range(self.n)]
        used = set().union(*self.weights[a:b])
        return sum(self.weight_bytes[w] for w in used) + sum(self.kv[a:b]) + max(self._live[a:b])

    def crossing(self, c: int) -> int:
        return sum(t.size for t in self.tensors if t.producer < c <= max(t.last, t.producer))


def speed_of(m: Machine) -> Fraction:
    return Fraction(m.speed)


def brute_force(inst: Instance, machines: list[Machine], allow_empty: bool = False):
    """(bottleneck, cut bytes, bounds) of the best plan by enumeration, or None."""
    n, S = inst.n, len(machines)
    cuts = (itertools.combinations_with_replacement(range(n + 1), S - 1) if allow_empty
            else itertools.combinations(range(1, n), S - 1))
    best = None
    for inner in cuts:
        bounds = (0, *inner, n)
        stages = list(zip(bounds, bounds[1:]))
        if any(m.capacity is not None and inst.memory(a, b) > m.capacity for (a, b), m in zip(stages, machines)):
            continue
        worst = max(Fraction(sum(inst.compute[a:b])) / speed_of(m) for (a, b), m in zip(stages, machines))
        moved = sum(inst.crossing(c) for c in set(bounds) if 0 < c < n)
        key = (worst, moved, bounds)
        best = key if best is None or key < best else best
    return best


def dp_oracle(inst: Instance, machines: list[Machine]):
    """The O(S n^2) dynamic program: (optimal bottleneck, fewest cut bytes at it), or None."""
    n, S = inst.n, len(machines)
    mem = {(a, b): inst.memory(a, b) for a in range(n) for b in range(a + 1, n + 1)}
    fits = {(k, a, b): m.capacity is None or mem[a, b] <= m.capacity
            for k, m in enumerate(machines) for a, b in mem}
    time = {(k, a, b): Fraction(sum(inst.compute[a:b])) / speed_of(m)
            for k, m in enumerate(machines) for a, b in mem}
    inf = None
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    best[0][0] = Fraction(0)
    for k in range(S):
        for b in range(1, n + 1):
            for a in range(b):
                if best[k][a] is not None and fits[k, a, b]:
                    t = max(best[k][a], time[k, a, b])
                    if best[k + 1][b] is None or t < best[k + 1][b]:
                        best[k + 1][b] = t
    top = best[S][n]
    if top is None:
        return None
    moved = [[None] * (n + 1) for _ in range(S + 1)]
    moved[0][0] = 0
    for k in range(S):
        for b in range(1, n + 1):
            for a in range(b):
                if moved[k][a] is not None and fits[k, a, b] and time[k, a, b] <= top:
                    x = moved[k][a] + (inst.crossing(a) if a > 0 else 0)
                    if moved[k + 1][b] is None or x < moved[k + 1][b]:
                        moved[k + 1][b] = x
    return top, moved[S][n]


def random_instance(rng: np.random.Generator, n: int) -> Instance:
    pool = [f"w{i}" for i in range(int(rng.integers(1, n + 2)))]
    weights = [list(rng.choice(pool, size=int(rng.integers(0, 3)))) for _ in range(n)]
    tensors = []
    for t in range(int(rng.integers(0, 2 * n + 1))):
        p = int(rng.integers(-1, n))
        last = int(rng.integers(p, n + 1)) if p >= 0 else int(rng.integers(0, n + 1))
        act = None if rng.random() < 0.8 else 0
        tensors.append(TensorUse(f"t{t}", int(rng.integers(0, 9)), p, last, act))
    return Instance(
        compute=rng.integers(0, 7, size=n).tolist(),
        kv=(rng.integers(0, 5, size=n) * (rng.random(n) < 0.4)).tolist(),
        weights=weights,
        weight_bytes={w: int(rng.integers(1, 11)) for w in pool},
        tensors=tensors,
    )


SPEEDS = [Fraction(1), Fraction(2), Fraction(3), Fraction(1, 2), Fraction(3, 2), Fraction(2, 3)]


def random_machines(rng: np.random.Generator, inst: Instance, S: int) -> list[Machine]:
    singles = [inst.memory(i, i + 1) for i in range(inst.n)]
    whole = inst.memory(0, inst.n)
    machines = []
    for k in range(S):
        cap = None if rng.random() < 0.15 else int(rng.integers(min(singles), whole + 2))
        machines.append(Machine(cap, SPEEDS[int(rng.integers(len(SPEEDS)))], name=f"m{k}"))
    return machines


def solve_or_none(inst, machines, allow_empty=False):
    try:
        sol = solve(inst.costs(), machines, allow_empty=allow_empty)
    except InfeasiblePlanError:
        return None
    return sol.bottleneck, sol.cut_bytes, sol.bounds


# -- the interval memory model against the brute force -------------------------------------------
def test_interval_memory_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(60):
        inst = random_instance(rng, int(rng.integers(1, 14)))
        mem = IntervalMemory(inst.costs())
        a, b = np.triu_indices(inst.n + 1, k=1)
        expect = [inst.memory(x, y) for x, y in zip(a.tolist(), b.tolist())]
        assert mem.total(a, b).tolist() == expect
        assert inst.costs().cut[1:inst.n].tolist() == [inst.crossing(c) for c in range(1, inst.n)]


def test_shared_weight_counted_once_per_interval_with_many_repeats():
    # One weight used by every node (ALBERT-style sharing) and another by every other node.
    n = 40
    inst = Instance([1] * n, [0] * n, [["shared"] + (["half"] if i % 2 else []) for i in range(n)],
                    {"shared": 100, "half": 7}, [])
    mem = IntervalMemory(inst.costs())
    a, b = np.triu_indices(n + 1, k=1)
    assert mem.weights(a, b).tolist() == [inst.memory(x, y) for x, y in zip(a.tolist(), b.tolist())]


# -- optimality: hundreds of random instances -----------------------------------------------------
def test_optimal_against_brute_force_on_random_instances():
    rng = np.random.default_rng(2024)
    checked = feasible_seen = 0
    for _ in range(400):
        inst = random_instance(rng, int(rng.integers(1, 9)))
        S = int(rng.integers(1, min(4, inst.n) + 1))
        machines = random_machines(rng, inst, S)
        expect = brute_force(inst, machines)
        assert solve_or_none(inst, machines) == expect, (inst, machines)
        checked += 1
        feasible_seen += expect is not None
    assert checked == 400 and feasible_seen > 150  # both outcomes well represented


def test_optimal_with_empty_stages_against_brute_force():
    rng = np.random.default_rng(99)
    for _ in range(200):
        inst = random_instance(rng, int(rng.integers(1, 7)))
        machines = random_machines(rng, inst, int(rng.integers(1, 5)))
        assert solve_or_none(inst, machines, allow_empty=True) == brute_force(inst, machines, True)


def test_optimal_against_dynamic_program_on_larger_instances():
    rng = np.random.default_rng(11)
    feasible_seen = 0
    for _ in range(120):
        inst = random_instance(rng, int(rng.integers(8, 26)))
        machines = random_machines(rng, inst, int(rng.integers(2, 6)))
        got = solve_or_none(inst, machines)
        expect = dp_oracle(inst, machines)
        assert (got and got[:2]) == expect, (inst, machines)
        feasible_seen += expect is not None
    assert feasible_seen > 40


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_optimal_property(data):
    n = data.draw(st.integers(1, 8), label="n")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    inst = random_instance(rng, n)
    machines = random_machines(rng, inst, data.draw(st.integers(1, min(n, 4)), label="S"))
    assert solve_or_none(inst, machines) == brute_force(inst, machines)


# -- the cases a correct partitioner must get right (notes, "Cases") ------------------------------
def weights_only(sizes: list[int], compute: list[int] | None = None) -> CostModel:
    names = [f"w{i}" for i in range(len(sizes))]
    return CostModel.from_parts(compute or [1] * len(sizes), weights=[[w] for w in names],
                                weight_bytes=dict(zip(names, sizes)))


def machines_of(budgets, speeds=None) -> list[Machine]:
    speeds = speeds or [1] * len(budgets)
    return [Machine(b, s, name=f"m{k}") for k, (b, s) in enumerate(zip(budgets, speeds))]


def test_case1_node_larger_than_every_budget_is_named():
    costs = CostModel.from_parts([1, 1, 1], weights=[["a"], ["big"], ["c"]],
                                 weight_bytes={"a": 5, "big": 50, "c": 5}, node_ids=[10, 11, 12],
                                 ops=["Matmul", "Matmul", "Add"])
    with pytest.raises(InfeasiblePlanError) as e:
        solve(costs, machines_of([20, 30]))
    assert e.value.kind == "node_too_large"
    msg = str(e.value)
    assert "node 11 (Matmul)" in msg and "50 bytes" in msg and "largest budget" in msg and "30 B" in msg


def test_case2_total_fits_but_no_contiguous_split():
    with pytest.raises(InfeasiblePlanError) as e:
        solve(weights_only([6, 6, 6]), machines_of([10, 10]))
    assert e.value.kind == "contiguity"
    assert "fits the budgets' sum" in str(e.value) and "contiguous" in str(e.value)
    assert not feasible(weights_only([6, 6, 6]), machines_of([10, 10]))


def test_case3_barely_feasible():
    sol = solve(weights_only([10] * 8), machines_of([20] * 4))
    assert sol.bounds == (0, 2, 4, 6, 8)
    with pytest.raises(InfeasiblePlanError):
        solve(weights_only([10] * 8), machines_of([19] * 4))


def test_case3_barely_feasible_is_memory_bound_not_compute_bound():
    # Compute alone would put 6 nodes on the fast machine; memory caps each stage at 2 nodes.
    sol = solve(weights_only([10] * 8), machines_of([20] * 4, speeds=[10, 1, 1, 1]))
    assert sol.bounds == (0, 2, 4, 6, 8)


def test_case4_tied_weight_in_first_and_last_stage():
    costs = CostModel.from_parts([1, 1, 1, 1], weights=[["embed"], ["w1"], ["w2"], ["embed"]],
                                 weight_bytes={"embed": 100, "w1": 1, "w2": 1})
    # Each stage must hold "embed" (100) plus what is between: 101 fits, 102 does not.
    sol = solve(costs, machines_of([101, 101]))
    assert sol.bounds == (0, 2, 4)
    mem = IntervalMemory(costs)
    assert mem.weights([0, 2], [2, 4]).tolist() == [101, 101]
    assert set(costs.stage_weights(2, 4)) == {"w2", "embed"}
    with pytest.raises(InfeasiblePlanError):
        solve(costs, machines_of([100, 100]))


def test_case6_speeds_one_to_two():
    sol = solve(CostModel.from_parts([1] * 30), machines_of([None, None], speeds=[1, 2]))
    assert sol.bounds == (0, 10, 30) and sol.bottleneck == 10
    sol = solve(CostModel.from_parts([1] * 30), machines_of([None, None], speeds=[2, 1]))
    assert sol.bounds == (0, 20, 30)


def test_case7_equal_bottleneck_takes_the_smaller_cut():
    # Nodes 0..3 of compute [2, 0, 0, 2]: cuts at 1, 2 or 3 all give bottleneck 2.  The tensor
    # crossing boundary 2 is the smallest.
    tensors = [TensorUse("big0", 50, 0, 1), TensorUse("small", 1, 1, 2), TensorUse("big2", 40, 2, 3)]
    costs = CostModel.from_parts([2, 0, 0, 2], tensors=tensors)
    assert costs.cut[1:4].tolist() == [50, 1, 40]
    sol = solve(costs, machines_of([None, None]))
    assert sol.bounds == (0, 2, 4) and sol.cut_bytes == 1 and sol.bottleneck == 2


def test_case7_ties_in_cut_bytes_break_to_the_earliest_boundary():
    costs = CostModel.from_parts([2, 0, 0, 2])  # no tensors: every cut is free
    assert solve(costs, machines_of([None, None])).bounds == (0, 1, 4)
    runs = {solve(costs, machines_of([None, None])).bounds for _ in range(5)}
    assert runs == {(0, 1, 4)}


def test_case8_tensor_counted_once_per_cut_and_at_every_boundary_it_skips():
    # "x" is produced by node 0 and consumed by nodes 1, 2 and 5: it crosses boundaries 1..5
    # once each (not once per consumer).  "y" lives 2..3.
    tensors = [TensorUse("x", 10, 0, 5), TensorUse("y", 3, 2, 3)]
    costs = CostModel.from_parts([1] * 6, tensors=tensors)
    assert costs.cut.tolist() == [0, 10, 10, 13, 10, 10, 0]
    sol = solve(costs, machines_of([None] * 3))
    assert sol.bounds == (0, 2, 4, 6)
    assert sol.cut_bytes == 20  # x at both boundaries: it skips over the middle stage
    assert set(costs.tensors.crossing(2)) == {"x"} and set(costs.tensors.crossing(3)) == {"x", "y"}


def test_case9_more_stages_than_nodes():
    with pytest.raises(InfeasiblePlanError) as e:
        solve(CostModel.from_parts([1, 1, 1]), machines_of([None] * 4))
    assert e.value.kind == "more_stages_than_nodes"
    assert "4 stages" in str(e.value) and "only 3 nodes" in str(e.value)
    sol = solve(CostModel.from_parts([1, 1, 1]), machines_of([None] * 4), allow_empty=True)
    assert sol.bounds == (0, 0, 1, 2, 3) and sol.bottleneck == 1


def test_heterogeneous_order_matters_and_greedy_alone_would_fail():
    # A small machine between two big ones: the farthest greedy would give m0 both small nodes
    # and leave m1 facing the big one.  Exact reach keeps the plan m0={s}, m1={s}, m2={B, s}.
    costs = weights_only([1, 1, 50, 1])
    sol = solve(costs, machines_of([100, 5, 100]))
    assert sol.bounds == (0, 1, 2, 4)


def test_zero_compute_and_single_stage():
    assert solve(CostModel.from_parts([0, 0, 0]), machines_of([None, None])).bottleneck == 0
    sol = solve(CostModel.from_parts([3, 4]), machines_of([None], speeds=[Fraction(1, 3)]))
    assert sol.bounds == (0, 2) and sol.bottleneck == 21


def test_large_chain_is_balanced_and_deterministic():
    rng = np.random.default_rng(5)
    n = 50_000
    compute = rng.integers(1, 1000, size=n)
    costs = CostModel.from_parts(compute.tolist())
    speeds = [1, 2, 1, Fraction(3, 2), 1, 2, 1, 1]
    machines = machines_of([None] * 8, speeds)
    sol = solve(costs, machines)
    ideal = Fraction(int(compute.sum())) / sum(Fraction(s) for s in speeds)
    assert float(sol.bottleneck / ideal) < 1.001
    assert solve(costs, machines).bounds == sol.bounds


# -- restricted cuts (layer granularity) are exact by coarsening ----------------------------------
def test_coarsening_keeps_interval_memory_and_the_optimum_over_allowed_cuts():
    from dist_runtime.partitioner.granularity import coarsen

    rng = np.random.default_rng(17)
    for _ in range(150):
        inst = random_instance(rng, int(rng.integers(2, 9)))
        allowed = sorted(set(rng.integers(1, inst.n, size=int(rng.integers(0, inst.n))).tolist()))
        coarse = coarsen(inst.costs(), np.array(allowed, dtype=np.int64))
        starts = coarse.starts.tolist()
        mem = IntervalMemory(coarse)
        for u in range(coarse.n):
            for v in range(u + 1, coarse.n + 1):
                assert int(mem.total(u, v)) == inst.memory(starts[u], starts[v])
        S = int(rng.integers(1, min(3, coarse.n) + 1))
        machines = random_machines(rng, inst, S)
        best = None
        for inner in itertools.combinations(allowed, S - 1):
            bounds = (0, *inner, inst.n)
            stages = list(zip(bounds, bounds[1:]))
            if any(m.capacity is not None and inst.memory(a, b) > m.capacity for (a, b), m in zip(stages, machines)):
                continue
            worst = max(Fraction(sum(inst.compute[a:b])) / m.speed for (a, b), m in zip(stages, machines))
            key = (worst, sum(inst.crossing(c) for c in inner), bounds)
            best = key if best is None or key < best else best
        try:
            sol = solve(coarse, machines)
            got = (sol.bottleneck, sol.cut_bytes, tuple(starts[b] for b in sol.bounds))
        except InfeasiblePlanError:
            got = None
        assert got == best


# -- the exact-fit memory boundary: a stage whose memory equals its budget fits, one byte more not --
U = 1000  # bytes per node of the component that fills the budget
R = 50 * U  # the reserve, when the reserve is what fills the budget


def fill(component: str, n: int) -> tuple[CostModel, int]:
    """``n`` nodes of equal compute, the memory of each in one component: a stage of two nodes
    needs 2U (one node alone: U, or 2U at odd positions for activations, a stage's peak); and the
    reserve kept free on every budgeted machine (R when it is what fills the budget, else 0)."""
    own = dict(weights=[[f"w{i}"] for i in range(n)], weight_bytes={f"w{i}": U for i in range(n)})
    parts = {
        "weights": own,
        "kv": dict(kv=[U] * n),
        "activations": dict(tensors=[TensorUse(f"t{i}", U * (1 + i % 2), i, i) for i in range(n)]),
        "reserve": dict(own, weight_bytes={f"w{i}": 1 for i in range(n)}),
    }[component]
    return CostModel.from_parts([1] * n, **parts), R if component == "reserve" else 0


def need(costs: CostModel, a: int, b: int, reserve: int) -> int:
    """What stage ``[a, b)`` needs of a budget, reserve included."""
    return int(IntervalMemory(costs).total(a, b)) + reserve


COMPONENTS = ["weights", "kv", "activations", "reserve"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_stage_filling_its_budget_exactly_fits_one_byte_less_does_not(component):
    from dist_runtime.partitioner.planner import build_plan

    costs, reserve = fill(component, 4)
    budget = need(costs, 0, 2, reserve)
    machines = [Machine(budget, reserve=reserve, name="m0"), Machine(None, name="m1")]
    sol = solve(costs, machines)
    assert sol.bounds == (0, 2, 4)  # the balanced plan, stage 0 at its budget to the byte
    memory = build_plan(costs, machines, sol).stages[0].memory
    assert memory.total == memory.budget == budget
    assert getattr(memory, component) == max(memory.weights, memory.kv, memory.activations, memory.reserve)
    machines[0] = Machine(budget - 1, reserve=reserve, name="m0")
    assert solve(costs, machines).bounds == (0, 1, 4)  # stage 0 keeps one node


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_node_filling_its_budget_exactly_fits_one_byte_less_does_not(component):
    costs, reserve = fill(component, 4)
    budget = need(costs, 0, 1, reserve)
    assert solve(costs, [Machine(budget, reserve=reserve), Machine(None)]).bounds == (0, 1, 4)
    with pytest.raises(InfeasiblePlanError):
        solve(costs, [Machine(budget - 1, reserve=reserve), Machine(None)])


@pytest.mark.parametrize("length", [2, 3])
@pytest.mark.parametrize("component", COMPONENTS)
def test_every_stage_filling_its_budget_exactly_fits_one_byte_less_does_not(component, length):
    costs, reserve = fill(component, 4 * length)
    budget = need(costs, 0, length, reserve)
    assert solve(costs, [Machine(budget, reserve=reserve)] * 4).bounds == tuple(range(0, 4 * length + 1, length))
    assert not feasible(costs, [Machine(budget - 1, reserve=reserve)] * 4)


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_whole_model_filling_one_budget_exactly_fits_one_byte_less_does_not(component):
    costs, reserve = fill(component, 4)
    budget = need(costs, 0, 4, reserve)
    assert solve(costs, [Machine(budget, reserve=reserve)]).bounds == (0, 4)
    assert not feasible(costs, [Machine(budget - 1, reserve=reserve)])
    with pytest.raises(InfeasiblePlanError):
        solve(costs, [Machine(budget - 1, reserve=reserve)])
