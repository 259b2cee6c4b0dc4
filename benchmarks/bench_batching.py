"""Continuous batching: aggregate decode tokens/s against one session, in one process and on stages.

Model: the ~125M-parameter random Llama (hidden 768, 12 layers, 12 heads, 4 KV heads, FFN 2048,
vocab 32000), F32 and Q8_0 projections.  Requests are decode-heavy: ``--prompt`` (16) prompt tokens,
``--tokens`` (64) new tokens, greedy.  Every engine is batch-invariant (each session's tokens are
those it gets alone; the benchmark checks it).  Printed, each a median of ``--repeat`` runs with
configurations alternating within a round, and ratios within one run:

1. one process, F32: aggregate decode tok/s of 1, 8 and 16 sessions, ratio to 1 session;
2. one process, Q8_0: 1 and 8 sessions;
3. 2 and 3 stages on this one machine (1 micro-batch, the default for that placement, and S
   micro-batches), 8 sessions, ratio to one process with 8 sessions;
4. chunked prefill: 4 prompts of 512 tokens arrive while 8 sessions decode; inter-token latency of
   the decoding sessions (p50/p99) next to their decode step's time before the prompts came;
5. per-step overhead: the share of a batched pass not spent inside the executor (one process:
   driver, scheduler, sampling; stages with one micro-batch: transport and driver, from the
   telemetry: 1 - the stages' compute per step / the wall time per step);
6. ceilings: weight bytes per step / measured memory bandwidth, FLOPs per step / measured peak.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_batching.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
from dist_runtime.executor import GraphExecutor
from dist_runtime.engine import Inbox, LocalEngine, Request
from dist_runtime.kernels.quant import quantize
from dist_runtime.scheduling_defaults import DEFAULT_BATCH_TOKENS

CFG = LlamaConfig(vocab=32000, hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048)


def model_files(directory: Path) -> dict[str, Path]:
    """The F32 and Q8_0 models, written once (kept in the temporary directory between runs)."""
    from dist_runtime.model import load_model, save_model

    out = {}
    weights = None
    for kind in ("F32", "Q8_0"):
        path = directory / f"dist-runtime-bench-llama125m-{kind}.model"
        out[kind] = path
        if path.exists():
            with load_model(path, tensors=[], validate=False) as m:
                if m.metadata.get("config") == llama_metadata(CFG)["config"]:
                    continue
        print(f"writing {path} ...", flush=True)
        weights = weights or llama_weights(CFG, seed=0)
        w = weights if kind == "F32" else {n: quantize(v, DType.Q8_0) if n.endswith("proj.weight") else v
                                           for n, v in weights.items()}
        save_model(path, llama_graph(CFG), w, llama_metadata(CFG)).close()
    return out


def requests(n: int, prompt: int, tokens: int, tag: str = "s") -> list[Request]:
    rng = np.random.default_rng(n)
    return [Request(f"{tag}{i}", rng.integers(0, CFG.vocab, prompt).tolist(), tokens) for i in range(n)]


def decode_rate(stream) -> tuple[float, dict, list[float]]:
    """Aggregate decode tok/s (tokens after each session's first, over the time from the first
    first-token to the last token), the tokens, and every inter-token gap."""
    seen: dict = {}
    gaps = []
    for event in stream:
        now = time.perf_counter()
        times = seen.setdefault(event.session, [])
        if times:
            gaps.append(now - times[-1][0])
        times.append((now, event.token))
    first = min(ts[0][0] for ts in seen.values())
    last = max(ts[-1][0] for ts in seen.values())
    decoded = sum(len(ts) - 1 for ts in seen.values())
    return decoded / (last - first), {s: [t for _, t in ts] for s, ts in seen.items()}, gaps


def local(path: Path, sessions: int, args, engine_cache: dict) -> tuple[float, dict]:
    engine = engine_cache.get(path)
    if engine is None:
        engine = engine_cache[path] = LocalEngine(GraphExecutor(path),
                                                  max_batch_tokens=args.max_batch_tokens)
    reqs = requests(sessions, args.prompt, args.tokens)
    rate, tokens, _ = decode_rate(engine.stream(reqs))
    for r in reqs:
        engine.executor.close_session(r.session)
    return rate, tokens


def local_overhead(path: Path, args, engine_cache: dict) -> float:
    """The share of one process's run with 8 sessions spent outside the executor's passes (the
    scheduler, sampling, building the batches)."""
    engine = engine_cache[path]
    run_batch, inside = engine.executor.run_batch, [0.0]

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return run_batch(*a, **kw)
        finally:
            inside[0] += time.perf_counter() - t0

    engine.executor.run_batch = timed
    reqs = requests(8, args.prompt, args.tokens)
    t0 = time.perf_counter()
    for _ in engine.stream(reqs):
        pass
    wall = time.perf_counter() - t0
    del engine.executor.run_batch
    for r in reqs:
        engine.executor.close_session(r.session)
    return 1 - inside[0] / wall


def chunked_prefill(path: Path, args, engine_cache: dict) -> dict:
    """8 sessions decode; after 8 of their tokens, 4 prompts of 512 tokens arrive.  The decoders'
    gaps between tokens before the prompts came are the decode step of this run (the reference);
    the gaps after it, the latency under chunked prefill."""
    engine = engine_cache[path]
    decoding = requests(8, args.prompt, args.tokens, "d")
    long = requests(4, 512, 4, "p")
    inbox = Inbox()
    before, after, last, arrived, firsts = [], [], {}, None, []
    for event in engine.stream(decoding, inbox=inbox):
        now = time.perf_counter()
        if str(event.session).startswith("p") and event.index == 0:
            firsts.append(now - arrived)
        if event.session in last and str(event.session).startswith("d"):
            (before if arrived is None else after).append(now - last[event.session])
        last[event.session] = now
        if event.index == 8 and event.session == "d0" and arrived is None:
            arrived = now
            for r in long:
                inbox.put(r)
    for r in decoding + long:
        engine.executor.close_session(r.session)
    after.sort()
    return {"p50": after[len(after) // 2], "p99": after[min(len(after) - 1, int(0.99 * len(after)))],
            "max": after[-1], "step": statistics.median(before), "ttft": max(firsts)}


def open_pipelines(path: Path) -> dict:
    """2 and 3 stages on this machine, 1 micro-batch (the default for that placement) and S, each
    stage's threads as placement chooses them by default (the CLI's), all deployed at once in one
    embedded Ray (its CPU count raised so that every reservation fits: the stages of the pipeline
    not running are idle, blocked on their sockets) so that the rounds can alternate them with one
    process."""
    from dist_runtime.pipeline.cluster import connect
    from dist_runtime.pipeline.launch import Pipeline
    from dist_runtime.pipeline.options import StageOptions

    connect(num_cpus=8)
    return {(stages, micro): Pipeline(path, stages=stages, max_context=1024, micro_batches=micro,
                                      options=StageOptions(cpus=2 / stages))
            for stages in (2, 3) for micro in (1, stages)}


def pipeline_rate(pipe, args) -> tuple[float, dict, dict]:
    reqs = requests(8, args.prompt, args.tokens)
    rate, tokens, _ = decode_rate(pipe.coordinator.stream(reqs))
    for r in reqs:
        pipe.coordinator.close_session(r.session)
    return rate, tokens, pipe.coordinator.last_run.summary()


def ceilings(path: Path, rows: int) -> dict:
    """Weight bytes per step / bandwidth (a large copy), FLOPs / peak (a large f32 GEMM)."""
    from dist_runtime.model import load_model

    with load_model(path, validate=False) as m:
        weight_bytes = sum(m.tensor(n).nbytes for n in m.graph.weights if "embed_tokens" not in n)
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        t.append(time.perf_counter() - t0)
    bandwidth = 2 * a.nbytes / statistics.median(t)  # read + write
    x = np.ones((1024, 1024), np.float32)
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        x @ x
        t.append(time.perf_counter() - t0)
    peak = 2 * 1024 ** 3 / statistics.median(t)
    macs = sum(CFG.hidden * n for n in (CFG.hidden, CFG.hidden // CFG.heads * CFG.kv_heads * 2, CFG.hidden)) \
        * CFG.layers + 3 * CFG.hidden * CFG.ffn * CFG.layers + CFG.hidden * CFG.vocab
    return {"weight_bytes": weight_bytes, "bandwidth": bandwidth, "peak": peak,
            "step_floor_ms": 1e3 * weight_bytes / bandwidth, "flop_floor_ms": 1e3 * 2 * macs * rows / peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--skip-pipeline", action="store_true", help="one process only")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                        help="rows per pass (default: %(default)s, the engines' default)")
    args = parser.parse_args()
    files = model_files(args.dir)
    engines: dict = {}
    rows: dict = {}
    alone: dict = {}
    prefills, stage_rows, summaries, same = [], {}, {}, {}
    pipes = {} if args.skip_pipeline else open_pipelines(files["F32"])
    try:
        for _ in range(args.repeat):  # every configuration once a round: a burst of load hits all alike
            for kind, counts in (("F32", (1, 8, 16)), ("Q8_0", (1, 8))):
                for n in counts:
                    rate, tokens = local(files[kind], n, args, engines)
                    rows.setdefault((kind, n), []).append(rate)
                    if n == 8:
                        alone.setdefault(kind, tokens)
            reference = rows[("F32", 8)][-1]
            prefills.append(chunked_prefill(files["F32"], args, engines))
            for key, pipe in pipes.items():
                rate, tokens, summaries[key] = pipeline_rate(pipe, args)
                stage_rows.setdefault(key, []).append(rate / reference)
                same[key] = same.get(key, True) and tokens == alone["F32"]
        report(args, files, engines, rows, prefills, stage_rows, summaries, same)
    finally:
        for pipe in pipes.values():
            pipe.close()


def report(args, files, engines, rows, prefills, stage_rows, summaries, same) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n125M Llama, {args.prompt}-token prompts, {args.tokens} new tokens, median of {args.repeat} rounds")
    print("| engine | sessions | aggregate decode tok/s | vs 1 session |\n|---|---|---|---|")
    for (kind, n), rate in med.items():
        print(f"| one process, {kind} | {n} | {rate:.1f} | {rate / med[(kind, 1)]:.2f}x |")
    ceil = {kind: ceilings(files[kind], 8) for kind in files}
    for kind, c in ceil.items():
        print(f"ceilings {kind}: weights {c['weight_bytes'] / 1e6:.0f} MB per step / {c['bandwidth'] / 1e9:.1f} GB/s "
              f"= {c['step_floor_ms']:.2f} ms; 8 rows' FLOPs / {c['peak'] / 1e9:.0f} GFLOP/s = "
              f"{c['flop_floor_ms']:.2f} ms")
    print(f"one process, 8 sessions: {100 * local_overhead(files['F32'], args, engines):.1f}% of the run "
          f"outside the executor's passes (scheduler, sampling, batching)")
    print("chunked prefill (4 x 512-token prompts arriving while 8 sessions decode), per round: "
          "inter-token p50 / p99 / max ms, the same sessions' decode step before the prompts came, p99 / step, "
          "the last long prompt's first token after they came")
    for p in prefills:
        print(f"  {1e3 * p['p50']:.1f} / {1e3 * p['p99']:.1f} / {1e3 * p['max']:.1f} ms, step {1e3 * p['step']:.1f} ms, "
              f"p99 / step = {p['p99'] / p['step']:.2f}, {p['ttft']:.2f} s")
    print(f"  median p99 / step {statistics.median(p['p99'] / p['step'] for p in prefills):.2f} (target <= 2)")
    if not stage_rows:
        return
    print("| pipeline (this machine) | micro-batches | 8 sessions vs one process 8, per round | median | "
          "same tokens | overhead / step |\n|---|---|---|---|---|---|")
    for (stages, micro), ratios in stage_rows.items():
        summary = summaries[(stages, micro)]
        compute = sum(s["compute"] for s in summary["stages"])
        step_ms = 1e3 * summary["wall_s"] / max(summary["steps"], 1)
        overhead = f"{100 * max(0.0, 1 - compute / step_ms):.0f}%" if micro == 1 else "-"
        print(f"| {stages} stages | {micro} | {' '.join(f'{r:.2f}x' for r in ratios)} | "
              f"{statistics.median(ratios):.2f}x | {same[(stages, micro)]} | {overhead} |")

if __name__ == "__main__":
    main()
