"""Fusion and backends: decode ms/token (and prefill ms) of a random Llama, per variant.

The model is ~125M-parameter-shaped but shallower (hidden 768, 12 heads, 4 KV heads, FFN 2048,
vocab 32000, ``--layers`` 4 by default), f32 random weights.  Each round, for every variant in
turn (interleaved, since this machine is shared and noisy), the session is reset, a
``--prompt``-token prefill is timed, then ``--steps`` greedy decode steps; a round's decode figure
is the mean ms/token of its steps, and the table shows the median over ``--rounds`` rounds and
the ratio to the unfused CPU run.

Variants (``fuse=False`` and a pre-fused graph are passed to the executor):

- ``cpu unfused``                      -- the graph as built;
- ``cpu fused (default)``              -- ``fuse_graph`` with its defaults (what ``fuse=True`` does);
- ``cpu fused, norm->q/k/v too``       -- also FusedNormMatmul into the 3 projections of the one
  norm that pattern 2 leaves (layer 0's), ``norm_matmul_max_consumers=3``;
- ``cpu fused, norm->q/k/v not skip``  -- no add->rmsnorm; every attention norm recomputed in
  its q/k/v projections instead: the direct comparison behind ``NORM_MATMUL_MAX_CONSUMERS``;
- ``numpy-blas unfused`` / ``fused`` -- the matmul family on the numpy-blas backend.

Run it as::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_fusion.py

Figures on this machine (2 shared cores, AMD EPYC, OpenBLAS), medians of
25-30 interleaved rounds at load average 1.4-1.8; ratios are to ``cpu unfused`` in the same run:

    768 shape, 4 layers (74M params)   decode ms/tok  ratio | prefill ms  ratio | nodes
    cpu unfused                           17.55      1.000  |   67.80    1.000  |   68
    cpu fused (default)                   17.58      1.001  |   59.65    0.880  |   52
    cpu fused, norm->q/k/v too            17.63      1.005  |   61.05    0.900  |   51
    cpu fused, norm->q/k/v not skip       17.85      1.017  |   60.78    0.896  |   55
    numpy-blas unfused                    16.14      0.920  |   58.54    0.863  |   68
    numpy-blas fused                      16.04      0.914  |   56.81    0.838  |   52

    hidden 64, 4 layers (dispatch-bound)  decode ms/tok  ratio | prefill ms  ratio
    cpu unfused                            3.51      1.000  |    4.31    1.000
    cpu fused (default)                    3.39      0.965  |    4.14    0.960
    cpu fused, norm->q/k/v not skip        3.66      1.043  |    4.47    1.038
    numpy-blas unfused / fused             2.46 / 2.41       |    3.17 / 3.04

    norm -> q/k/v alone, fused / unfused:  cpu 1.19 (1 row), 1.10 (16), 1.09 (128);
                                           numpy-blas 1.26, 1.07, 1.08

Reading: at the 768 shape a decode step reads ~300 MB of weights and fusion is within noise
(the prefill gain of the first table is not reproducible from run to run; best-round ratios are
0.97-1.00); where dispatch dominates (hidden 64) the default fusion saves 3-4%.  Recomputing a
norm per q/k/v projection always loses (hence ``NORM_MATMUL_MAX_CONSUMERS = 1``), and
add->rmsnorm beats it.

(OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE: see /work/shared/notes/performance.md.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.fusion import fuse_graph
from dist_runtime.ir.graph import Graph, TensorSpec


def with_specs(graph: Graph, weights: dict) -> Graph:
    specs = {n: TensorSpec(w.shape, DType.from_numpy(w.dtype)) for n, w in weights.items()}
    return Graph(graph.nodes, graph.inputs, graph.outputs, specs)


def variants(graph: Graph, weights: dict) -> dict[str, GraphExecutor]:
    out = {
        "cpu unfused": GraphExecutor((graph, weights), fuse=False),
        "cpu fused (default)": GraphExecutor((graph, weights), fuse=True),
        "cpu fused, norm->q/k/v too": GraphExecutor(
            (fuse_graph(graph, norm_matmul_max_consumers=3), weights), fuse=False),
        "cpu fused, norm->q/k/v not skip": GraphExecutor(
            (fuse_graph(graph, norm_matmul_max_consumers=3, patterns=("swiglu", "norm_matmul")), weights),
            fuse=False),
    }
    out["numpy-blas unfused"] = GraphExecutor((graph, weights), backends=["numpy-blas"], fuse=False)
    out["numpy-blas fused"] = GraphExecutor((graph, weights), backends=["numpy-blas"])
    return out


def one_round(ex: GraphExecutor, prompt: np.ndarray, steps: int) -> tuple[float, float]:
    """(prefill ms, mean decode ms/token) for one reset session."""
    ex.reset()
    t0 = time.perf_counter()
    out = ex.run({"tokens": prompt})
    prefill = time.perf_counter() - t0
    token = np.asarray(out["next_token"]).reshape(-1)[-1:].astype(np.int32)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = np.asarray(ex.run({"tokens": token})["next_token"]).reshape(-1)[-1:].astype(np.int32)
    return prefill * 1e3, (time.perf_counter() - t0) * 1e3 / steps


def qkv_table(rounds: int) -> None:
    """The rule behind NORM_MATMUL_MAX_CONSUMERS, measured on its own: one RmsNorm feeding the
    q/k/v projections of a layer (768 -> 768, 256, 256), as 1 norm + 3 Matmuls or as 3
    FusedNormMatmuls (the norm recomputed per consumer), per backend and number of rows."""
    from dist_runtime.ir import Matmul, Node, RmsNorm

    rng = np.random.default_rng(1)
    weights = {"nw": np.ones(768, np.float32)}
    for name, n in (("Wq", 768), ("Wk", 256), ("Wv", 256)):
        weights[name] = (rng.standard_normal((n, 768)) / 28).astype(np.float32)
    nodes = [Node(0, RmsNorm(eps=1e-5), ["x", "nw"], ["n"])]
    nodes += [Node(i + 1, Matmul(), ["n", w], [o]) for i, (w, o) in enumerate((("Wq", "q"), ("Wk", "k"), ("Wv", "v")))]
    graph = with_specs(Graph(nodes, [TensorSpec((-1, 768), DType.F32)], ["q", "k", "v"]), weights)
    fused = fuse_graph(graph, norm_matmul_max_consumers=3)

    print(f"\nnorm -> q/k/v alone (1 RmsNorm + 3 Matmul vs 3 FusedNormMatmul), best of {rounds} x 50 runs, us")
    print(f"{'backend':12} {'rows':>5} {'unfused':>9} {'fused':>9} {'ratio':>6}")
    for backend in ("cpu", "numpy-blas"):
        exs = [GraphExecutor((g, weights), backends=[backend], fuse=False) for g in (graph, fused)]
        for rows in (1, 16, 128):
            x = {"x": rng.standard_normal((rows, 768)).astype(np.float32)}
            best = [float("inf")] * 2
            for _ in range(rounds):
                for k, ex in enumerate(exs):
                    t0 = time.perf_counter()
                    for _ in range(50):
                        ex.run(x)
                    best[k] = min(best[k], (time.perf_counter() - t0) / 50 * 1e6)
            print(f"{backend:12} {rows:5d} {best[0]:9.1f} {best[1]:9.1f} {best[1] / best[0]:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=16, help="prefill tokens")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", nargs="*", help="variant names to run (substring match)")
    parser.add_argument("--no-qkv", action="store_true", help="skip the norm -> q/k/v table")
    args = parser.parse_args()
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if var in os.environ:
            print(f"warning: {var} is set; it may slow OpenBLAS down (see the docstring)")

    cfg = LlamaConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=args.kv_heads, ffn=args.ffn)
    weights = llama_weights(cfg)
    graph = with_specs(llama_graph(cfg), weights)
    params = sum(w.size for w in weights.values())
    print(f"random Llama: {params / 1e6:.1f}M params, {cfg}")
    runs = variants(graph, weights)
    if args.only:
        runs = {k: v for k, v in runs.items() if k == "cpu unfused" or any(s in k for s in args.only)}
    prompt = np.arange(1, args.prompt + 1, dtype=np.int32)
    load_before = f"{os.getloadavg()[0]:.2f}"
    for ex in runs.values():  # warm up: page weights in, pack, start BLAS threads
        one_round(ex, prompt, 2)
    prefill: dict[str, list[float]] = {k: [] for k in runs}
    decode: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, ex in runs.items():
            p, d = one_round(ex, prompt, args.steps)
            prefill[name].append(p)
            decode[name].append(d)

    print(f"\n{args.layers} layers, {args.prompt}-token prompt, {args.steps} decode steps x "
          f"{args.rounds} rounds; load average before/after: {load_before} / {os.getloadavg()[0]:.2f}")
    print("median and best round; ratio = variant / cpu unfused (< 1 is faster)\n")
    head = f"{'':33}|{'decode ms/token':^29}|{'prefill ms':^29}|"
    print(head)
    print(f"{'variant':33}|{'median':>8} {'ratio':>6} {'best':>7} {'ratio':>5}|"
          f"{'median':>8} {'ratio':>6} {'best':>7} {'ratio':>5}| nodes")
    stats = {name: (statistics.median(decode[name]), min(decode[name]),
                    statistics.median(prefill[name]), min(prefill[name])) for name in runs}
    base = stats["cpu unfused"]
    for name, ex in runs.items():
        dm, db, pm, pb = stats[name]
        print(f"{name:33}|{dm:8.2f} {dm / base[0]:6.3f} {db:7.2f} {db / base[1]:5.2f}|"
              f"{pm:8.2f} {pm / base[2]:6.3f} {pb:7.2f} {pb / base[3]:5.2f}| {len(ex.graph.nodes):5d}")
    if not args.no_qkv:
        qkv_table(max(args.rounds // 3, 3))


if __name__ == "__main__":
    main()
