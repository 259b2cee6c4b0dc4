"""An elastic pipeline under HTTP load on simulated nodes: lose a node with no spare, gain one back.

The cluster is ``ray.cluster_utils.Cluster`` on this machine: a head of 0 CPUs and three nodes of
one CPU each with the label ``pool``.  The ~40M-parameter random Llama (vocab 16000, hidden 512, 8
layers, 8 heads, 4 KV heads, FFN 1408, F32; written once to the temporary directory) is served
by ``dist-runtime serve``'s server in this process on 3 stages, one per node, no spare; clients
stream completions over HTTP (httpx, SSE) from threads of this process.  Printed:

1. an undisturbed run: ``--sessions`` (8) streams of ``--tokens`` (64) greedy tokens, their tokens
   and aggregate tokens/s;
2. shrink: the same streams, the node of stage 1 removed after ``--at`` (16) tokens of the first
   stream: whether every stream completed with the undisturbed run's tokens, the longest gap
   between two tokens of a stream (target <= 5 s), the re-plan's phases; then the shrunk
   pipeline's tokens/s (median of ``--repeat`` runs);
3. grow: a node with the label joins; the pipeline's watch grows it back to 3 stages; the streams
   again: the same tokens;
4. a fresh 2-stage deployment on two nodes, tokens/s (median of ``--repeat``): the shrunk
   pipeline's throughput over it (target >= 0.9x);
5. with ``--soak SECONDS`` (600 for the issue's soak), steady load (``--sessions`` streams kept
   running by a client process of its own) while every ``--every`` (90) s a stage's node is
   removed or a node is added, in turn: requests lost (target 0), sessions left on the stages
   after (target 0), and the server's (this process's) resident memory after each change and the
   stages' at the start and end (target: flat).

    .venv/bin/python benchmarks/bench_elastic.py [--soak 600]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights

CFG = LlamaConfig(vocab=16000, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1408)
LABEL = {"pool": 0.01}
MODEL_ID = "dist-runtime-bench-llama40m-F32"  # the served name: the file's, without .model


def model_file() -> Path:
    from dist_runtime.model import load_model, save_model

    path = Path(tempfile.gettempdir()) / "dist-runtime-bench-llama40m-F32.model"
    if path.exists():
        with load_model(path, tensors=[], validate=False) as m:
            if m.metadata.get("config") == llama_metadata(CFG)["config"]:
                return path
    print(f"writing {path} ...", flush=True)
    save_model(path, llama_graph(CFG), llama_weights(CFG, seed=0), llama_metadata(CFG)).close()
    return path


def prompts(n: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(7)
    return [rng.integers(0, CFG.vocab, 12).tolist() for _ in range(n)]


class Serving:
    """The model served on a pipeline over the cluster's nodes, on 127.0.0.1."""

    def __init__(self, path: Path, stages: int, sessions: int, grow: bool = True) -> None:
        from dist_runtime.pipeline import Pipeline, StageOptions
        from dist_runtime.serve.metrics import Metrics
        from dist_runtime.serve.served_model import ServedModel
        from dist_runtime.serve.server import PipelineAdmin, Server, pipeline_backend, pipeline_health

        model = ServedModel.open(path, context=256)
        metrics = Metrics()
        options = StageOptions(cpus=1, resources=[LABEL] * stages, spare_timeout=5.0)
        self.pipe = Pipeline(path, stages=stages, max_context=256, sessions=sessions, options=options, grow=grow)
        backend = pipeline_backend(model, self.pipe, metrics, max_queue=64)
        self.server = Server(model, backend, metrics, port=0, health=pipeline_health(self.pipe),
                             on_close=self.pipe.close, admin=PipelineAdmin(self.pipe)).start()
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


def stream(url: str, prompt: list[int], tokens: int, out: dict, key, on_token=None) -> None:
    """One streamed completion: ``out[key]`` = (text, token arrival times, error)."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    text, times, error = "", [], None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message")
                    continue
                text += chunk["choices"][0]["text"]
                times.append(time.perf_counter())
                if on_token is not None:
                    on_token(len(times))
    except (httpx.HTTPError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    out[key] = (text, times, error)


def run_streams(url: str, asks: list[list[int]], tokens: int, on_first=None) -> tuple[dict, float]:
    """Every prompt streamed at once; (results by index, aggregate tokens/s)."""
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(url, p, tokens, out, i, on_first if i == 0 else None))
               for i, p in enumerate(asks)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return out, sum(len(times) for _, times, _ in out.values()) / wall


def longest_gap(out: dict) -> float:
    return max((b - a for _, times, _ in out.values() for a, b in zip(times, times[1:])), default=0.0)


def same(out: dict, want: dict) -> bool:
    return all(out[k][2] is None and out[k][0] == want[k][0] for k in want)


def node_of(cluster, node_id: str):
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def rss(pid: int | None = None) -> int:
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def mib(nbytes):
    """Bytes (or a list of them) in whole MiB."""
    return [mib(b) for b in nbytes] if isinstance(nbytes, list) else round(nbytes / 2**20)


def soak_clients(url: str, asks, tokens: int, stop, done, lost) -> None:
    """In a process of its own (the server's RSS is then the server's): one thread per prompt
    streaming completions until ``stop`` is set; ``done`` counts requests, ``lost`` gets the
    failures' reasons."""

    def client(i: int) -> None:
        while not stop.is_set():
            out: dict = {}
            stream(url, asks[i % len(asks)], tokens, out, 0)
            text, times, error = out[0]
            if error is not None or len(times) != tokens:
                lost.put(error or f"{len(times)} of {tokens} tokens")
            with done.get_lock():
                done.value += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def soak(cluster, serving: Serving, asks, tokens: int, seconds: float, every: float) -> None:
    import multiprocessing
    import queue

    import ray

    pipe, ctx = serving.pipe, multiprocessing.get_context("spawn")
    stop, done, lost_q = ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    lost: list = []

    def drain_lost() -> None:
        try:
            while True:
                lost.append(lost_q.get_nowait())
        except queue.Empty:
            pass

    clients = ctx.Process(target=soak_clients, args=(serving.url, asks, tokens, stop, done, lost_q))
    clients.start()
    time.sleep(min(every, 30.0) / 2)  # warmed up: the clients' streams are running
    start_rss = rss()
    stage_rss = [m["resident"] for m in pipe.memory()]
    t0, events, remove = time.monotonic(), [], True
    while time.monotonic() - t0 < seconds:
        time.sleep(min(every, max(0.0, seconds - (time.monotonic() - t0))))
        if time.monotonic() - t0 >= seconds:
            break
        before, replans, changed = len(pipe.stages), len(pipe.coordinator.replans), time.monotonic()
        if remove and len(pipe.stages) > 1:
            cluster.remove_node(node_of(cluster, pipe.reports[len(pipe.stages) // 2]["node_id"]))
            events.append("removed")
        else:
            cluster.add_node(num_cpus=1, resources={"pool": 1})
            events.append("added")
        remove = not remove
        while len(pipe.coordinator.replans) == replans and time.monotonic() - changed < 60:
            time.sleep(0.2)
        drain_lost()
        now = pipe.memory()
        print(f"  {time.monotonic() - t0:6.0f} s: node {events[-1]}; {before} -> {len(pipe.stages)} stage(s) "
              f"in {time.monotonic() - changed:.1f} s; {done.value} requests done, {len(lost)} lost; "
              f"server RSS {mib(rss())} MiB; stages' RSS {mib([m['resident'] for m in now])} "
              f"(weights {mib([m['weights'] for m in now])}) MiB", flush=True)
    loaded_rss, loaded_stages = rss(), [m["resident"] for m in pipe.memory()]
    stop.set()
    clients.join(300)
    drain_lost()
    time.sleep(1.0)
    left = sum(len(s) for s in ray.get([a.sessions.remote() for a in pipe.actors]))
    end_rss = rss()
    stage_end = [m["resident"] for m in pipe.memory()]
    print(f"\nsoak {seconds:.0f} s, a node {' / '.join(events[:2])} every {every:.0f} s ({len(events)} changes, "
          f"{len(pipe.coordinator.replans)} re-plans in all): {done.value} requests, {len(lost)} lost"
          f"{(': ' + str(lost[:3])) if lost else ''}; sessions left on the stages: {left}")
    print(f"server RSS {mib(start_rss)} -> {mib(loaded_rss)} MiB under load, {mib(end_rss)} after; stages' RSS "
          f"{mib(stage_rss)} -> {mib(loaded_stages)} under load, {mib(stage_end)} after "
          f"(the stages after the last change are not all the first ones)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8, help="concurrent streams (default: 8)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per stream (default: 64)")
    ap.add_argument("--at", type=int, default=16, help="tokens of the first stream before the fault (default: 16)")
    ap.add_argument("--repeat", type=int, default=3, help="throughput runs, median (default: 3)")
    ap.add_argument("--soak", type=float, default=0.0, metavar="SECONDS", help="soak length (default: 0, none)")
    ap.add_argument("--every", type=float, default=90.0, metavar="SECONDS", help="soak: node change interval")
    args = ap.parse_args()
    if min(args.sessions, args.tokens, args.repeat) < 1 or not 0 < args.at < args.tokens:
        ap.error("--sessions, --tokens and --repeat must be positive, and 0 < --at < --tokens")

    import logging

    import ray
    from ray.cluster_utils import Cluster

    logging.getLogger("dist_runtime.recovery").setLevel(logging.ERROR)  # the bench prints what happened
    path = model_file()
    asks = prompts(args.sessions)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1, resources={"pool": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="dist-runtime-bench", log_to_driver=False)
        serving = Serving(path, stages=3, sessions=args.sessions)
        pipe = serving.pipe
        try:
            want, base = run_streams(serving.url, asks, args.tokens)
            print(f"undisturbed, 3 stages: {args.sessions} streams x {args.tokens} tokens, {base:.1f} tok/s; "
                  f"errors: {[v[2] for v in want.values() if v[2]] or 'none'}")
            victim = pipe.reports[1]["node_id"]
            fired = threading.Event()

            def fault(n: int) -> None:
                if n == args.at and not fired.is_set():
                    fired.set()
                    threading.Thread(target=cluster.remove_node, args=(node_of(cluster, victim),)).start()

            got, _ = run_streams(serving.url, asks, args.tokens, on_first=fault)
            replan = pipe.coordinator.replans[-1] if pipe.coordinator.replans else None
            print(f"\nshrink: node of stage 1 removed after {args.at} tokens: all {args.sessions} streams complete "
                  f"with the undisturbed tokens: {same(got, want)}; longest gap between two tokens "
                  f"{longest_gap(got):.2f} s (target <= 5 s)")
            print(f"  {replan.line() if replan else 'no re-plan happened'}")
            shrunk = statistics.median(run_streams(serving.url, asks, args.tokens)[1] for _ in range(args.repeat))
            print(f"  shrunk pipeline ({len(pipe.stages)} stages): {shrunk:.1f} tok/s")

            cluster.add_node(num_cpus=1, resources={"pool": 1})
            deadline = time.monotonic() + 120
            while len(pipe.stages) < 3 and time.monotonic() < deadline:
                time.sleep(0.5)
            again, _ = run_streams(serving.url, asks, args.tokens)
            grow = pipe.coordinator.replans[-1]
            print(f"\ngrow: a node joined: {len(pipe.stages)} stages; the same tokens: {same(again, want)}")
            print(f"  {grow.line()}")
            if args.soak:
                soak(cluster, serving, asks, args.tokens, args.soak, args.every)
        finally:
            serving.close()

        # a fresh deployment on two nodes: the shrunk pipeline's reference
        for node in list(cluster.worker_nodes)[:-2]:
            cluster.remove_node(node)
        fresh = Serving(path, stages=2, sessions=args.sessions, grow=False)
        try:
            rates = [run_streams(fresh.url, asks, args.tokens)[1] for _ in range(args.repeat)]
        finally:
            fresh.close()
        rate = statistics.median(rates)
        print(f"\nfresh 2-stage deployment: {rate:.1f} tok/s; shrunk / fresh: {shrunk / rate:.2f}x (target >= 0.9x)")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
