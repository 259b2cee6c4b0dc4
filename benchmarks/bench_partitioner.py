"""Benchmark: plan a ~100k-node Llama-architecture graph on 8 heterogeneous machines.

    .venv/bin/python benchmarks/bench_partitioner.py [--layers 7142] [--repeat 3]

Prints, per run: the time to build the cost model from the graph (shape inference, FLOPs, weights,
KV, activations, cuts), to solve (exact bisection + fewest-cut-bytes DP), to build the plan, and
the total; the bottleneck / ideal ratio; the plan hash (identical on every run).  Also solves the
same problem at node granularity (cuts anywhere: ~100k units instead of ~7k layers) and a plain
100k-node synthetic cost array, to time the solver alone.  A benchmark, not a test: the numbers
depend on the machine (and on what else runs on it).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_runtime.dtypes import DType  # noqa: E402
from dist_runtime.examples import LlamaConfig, llama_graph  # noqa: E402
from dist_runtime.ir.graph import TensorSpec  # noqa: E402
from dist_runtime.units import format_bytes  # noqa: E402
from dist_runtime.partitioner.costs import CostModel  # noqa: E402
from dist_runtime.partitioner.graph_costs import graph_costs  # noqa: E402
from dist_runtime.partitioner.machines import Machine  # noqa: E402
from dist_runtime.partitioner.planner import build_plan, solve_at  # noqa: E402
from dist_runtime.partitioner.solver import solve  # noqa: E402

SPEEDS = [1, 2, Fraction(3, 2), 1, 3, 1, 2, Fraction(5, 4)]
BUDGET_SHARE = [0.10, 0.20, 0.16, 0.10, 0.30, 0.10, 0.20, 0.14]  # of the whole model's memory


def big_llama(layers: int) -> tuple:
    """A Llama graph with ``layers`` layers (14 nodes each, ~100k nodes for 7142) and weight specs."""
    cfg = LlamaConfig(vocab=512, hidden=64, layers=layers, heads=4, kv_heads=2, ffn=128)
    graph = llama_graph(cfg)
    kv, h, f = cfg.kv_heads * cfg.head_dim, cfg.hidden, cfg.ffn
    per_layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h),
                 "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
                 "self_attn.o_proj.weight": (h, h), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    weights = {"model.embed_tokens.weight": TensorSpec((cfg.vocab, h), DType.F32)}
    for i in range(layers):
        for name, shape in per_layer.items():
            weights[f"model.layers.{i}.{name}"] = TensorSpec(shape, DType.F32)
    weights["model.norm.weight"] = TensorSpec((h,), DType.F32)
    weights["lm_head.weight"] = TensorSpec((cfg.vocab, h), DType.F32)
    graph.weights = weights
    return graph


def machines_for(whole_bytes: int) -> list[Machine]:
    return [Machine(int(whole_bytes * share), speed, name=f"m{k}")
            for k, (share, speed) in enumerate(zip(BUDGET_SHARE, SPEEDS))]


def run(graph, args) -> tuple[str, dict]:
    cpu = time.process_time()
    t0 = time.perf_counter()
    graph.invalidate()  # the graph index is part of the work
    costs = graph_costs(graph, max_context=args.max_context, sessions=args.sessions, tokens=args.tokens)
    t1 = time.perf_counter()
    whole = int(costs.weight_bytes.sum() + costs.kv.sum() + costs.live.max())
    machines = machines_for(whole)
    sol, used = solve_at(costs, machines, "auto")
    t2 = time.perf_counter()
    plan = build_plan(costs, machines, sol, request={"granularity_used": used})
    t3 = time.perf_counter()
    return plan.hash, {
        "cpu": time.process_time() - cpu, "costs": t1 - t0, "solve": t2 - t1, "plan": t3 - t2, "total": t3 - t0, "ratio": plan.ratio,
        "granularity": used, "probes": sol.probes, "cut": plan.cut_bytes, "n": costs.n,
        "costs_obj": costs, "machines": machines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=7142)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per call (1: decode step)")
    args = ap.parse_args()
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    t = time.perf_counter()
    graph = big_llama(args.layers)
    print(f"graph: {len(graph.nodes):,} nodes, {len(graph.weights):,} weights "
          f"(built in {time.perf_counter() - t:.2f} s, not timed below)")
    hashes = set()
    for r in range(args.repeat):
        h, m = run(graph, args)
        hashes.add(h)
        print(f"run {r}: costs {m['costs']:.3f} s + solve {m['solve']:.3f} s + plan {m['plan']:.3f} s "
              f"= {m['total']:.3f} s (cpu {m['cpu']:.3f} s); bottleneck/ideal {m['ratio']:.4f} ({m['granularity']} granularity, "
              f"{m['probes']} probes); cut {format_bytes(m['cut'])}; hash {h[:16]}")
    print(f"same plan hash on every run: {len(hashes) == 1}")

    costs, machines = m["costs_obj"], m["machines"]
    t = time.perf_counter()
    sol = solve(costs, machines)
    ideal = Fraction(int(costs.compute.sum())) / sum(Fraction(s) for s in SPEEDS)
    print(f"node granularity ({costs.n:,} units): solve {time.perf_counter() - t:.3f} s, "
          f"bottleneck/ideal {float(sol.bottleneck / ideal):.4f}, {sol.probes} probes")

    rng = np.random.default_rng(0)
    n = 100_000
    synthetic = CostModel.from_parts(rng.integers(1, 10_000, size=n).tolist(),
                                     weights=[[f"w{i}"] for i in range(n)],
                                     weight_bytes={f"w{i}": int(b) for i, b in enumerate(rng.integers(1, 1000, size=n))})
    total = int(synthetic.weight_bytes.sum())
    synth_machines = [Machine(int(total * share), speed, name=f"m{k}")
                      for k, (share, speed) in enumerate(zip(BUDGET_SHARE, SPEEDS))]
    t = time.perf_counter()
    sol = solve(synthetic, synth_machines)
    ideal = Fraction(int(synthetic.compute.sum())) / sum(Fraction(s) for s in SPEEDS)
    print(f"synthetic 100k-node cost arrays, 8 machines: solve {time.perf_counter() - t:.3f} s, "
          f"bottleneck/ideal {float(sol.bottleneck / ideal):.4f}, {sol.probes} probes")


if __name__ == "__main__":
    main()
