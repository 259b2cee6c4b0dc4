"""``dist-runtime serve`` under load, next to the offline batched ``generate`` of the same requests.

The server runs in this process on 127.0.0.1 (an ephemeral port) over the ~125M-parameter random
Llama (hidden 768, 12 layers, F32; written once to the temporary directory, as
``bench_batching.py`` does), one continuously batched ``LocalEngine``.  The clients run in a
child process, as clients on other machines would not share the server's interpreter (in this
process their SSE parsing takes the GIL from the engine thread: 0.75-0.85x of the figures the
child gives below); they still share this machine's two cores with it.  Printed:

1. ``--clients`` (32) concurrent streaming clients (httpx, SSE), ``--requests`` (64) requests of
   ``--prompt`` (16) prompt ids and ``--tokens`` (32) greedy new tokens: aggregate tokens/s next to
   the offline batched generate of the same requests (same engine settings), in ``--rounds`` (3)
   rounds alternating the two (a burst of load from elsewhere slows both alike), each round's
   ratio and their median (target >= 0.9x); p50/p99 time to first token and inter-token latency;
   the server's overhead per token -- the CPU time of uvicorn's thread (HTTP, JSON, SSE) per token
   streamed, read from /proc -- against a batched decode step (target <= 10%);
2. the server process's resident memory over ``--memory-requests`` (10,000) short requests, 32 at a
   time, after 200 to warm up (target: < 20 MB growth);
3. a ``--turns`` (10) turn conversation through the openai client, each turn re-sending the whole
   history plus ``--turn-tokens`` (150) new prompt ids and asking for 16 tokens, on a server with
   the prefix cache (the default) and on one without: each turn's time to first token and cached
   prompt tokens, and whether the answers agree (target: turn 10's first token <= 1.5x turn 1's
   with the cache).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_serve.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


async def one_stream(client, url: str, prompt: list[int], tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return {"start": start, "stamps": stamps, "tokens": usage["completion_tokens"] if usage else len(stamps)}


async def load(url: str, all_prompts: list[list[int]], clients: int, tokens: int) -> tuple[float, list[dict]]:
    import httpx

    queue = list(all_prompts)
    results: list[dict] = []

    async def client_loop(client):
        while queue:
            results.append(await one_stream(client, url, queue.pop(), tokens))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        return time.perf_counter() - t0, results


async def short_requests(url: str, n: int, clients: int, vocab: int) -> None:
    import httpx

    left = [n]

    async def client_loop(client):
        while left[0] > 0:
            left[0] -= 1
            r = await client.post(f"{url}/v1/completions", json={"model": "bench", "prompt": [left[0] % vocab, 1],
                                                                   "max_tokens": 1, "temperature": 0})
            r.raise_for_status()

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))


def load_in_child(url: str, all_prompts: list[list[int]], clients: int, tokens: int) -> tuple[float, list[dict]]:
    """:func:`load` in a child process (this file with ``--client``): the prompts in on stdin,
    the wall time and per-request results out on stdout, as JSON."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, __file__, "--client", url, "--clients", str(clients), "--tokens", str(tokens)],
                          input=json.dumps(all_prompts), capture_output=True, text=True, check=True)
    wall, results = json.loads(done.stdout)
    return wall, results


def client_main(args) -> None:
    wall, results = asyncio.run(load(args.client, json.loads(sys.stdin.read()), args.clients, args.tokens))
    print(json.dumps([wall, results]))


def conversation(url: str, turns: int, new: int, vocab: int) -> list[tuple[float, int, list[int]]]:
    """Each turn's (seconds to its first token, cached prompt tokens, answer ids): the prompt is
    the whole conversation so far plus ``new`` ids, as a chat client re-sends it."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    rng, prompt, out = np.random.default_rng(1), [], []
    for _ in range(turns):
        prompt += rng.integers(1, vocab, new).tolist()
        start, first, text, cached = time.perf_counter(), None, "", 0
        for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter() - start
                text += chunk.choices[0].text
            if chunk.usage:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        answer = [int(t) for t in text.split()]  # no tokenizer: the ids, space-separated
        prompt += answer
        out.append((first, cached, answer))
    return out


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process."""
    import os

    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-requests", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=10, help="turns of the conversation (0: leave it out)")
    parser.add_argument("--turn-tokens", type=int, default=150, help="new prompt ids a turn")
    parser.add_argument("--skip-load", action="store_true", help="only the conversation")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the child: load URL, print JSON
    args = parser.parse_args()
    if args.client:
        return client_main(args)

    from bench_batching import CFG, model_files

    from dist_runtime.engine import LocalEngine, Request, generate
    from dist_runtime.executor import GraphExecutor
    from dist_runtime.scheduling_defaults import DEFAULT_BATCH_TOKENS
    from dist_runtime.serve.metrics import Metrics
    from dist_runtime.serve.served_model import ServedModel
    from dist_runtime.serve.server import Server, local_backend

    path = model_files(args.dir)["F32"]
    asks = prompts(args.requests, args.prompt, CFG.vocab)
    engine = LocalEngine(GraphExecutor(path), max_batch_tokens=DEFAULT_BATCH_TOKENS)
    generate(engine, [Request("warm", asks[0], 2)])
    engine.max_sessions = args.clients  # as many at once as the server will see

    model = ServedModel.open(path, name="bench")
    if args.turns:
        chats = {}
        for cache in (True, False):
            metrics = Metrics()
            backend = local_backend(model, metrics, max_batch_tokens=DEFAULT_BATCH_TOKENS, max_queue=8,
                                    prefix_cache=None if cache else 0)
            with Server(model, backend, metrics, port=0) as server:
                conversation(server.url, 1, 8, CFG.vocab)  # warm-up
                chats[cache] = conversation(server.url, args.turns, args.turn_tokens, CFG.vocab)
        print(f"\n{args.turns}-turn conversation, {args.turn_tokens} new prompt ids and 16 answer tokens a turn")
        print("| turn | prompt tokens | first token, cache | cached tokens | first token, no cache | same answer |")
        print("|---|---|---|---|---|---|")
        length = 0
        for t, ((on, cached, a), (off, _, b)) in enumerate(zip(chats[True], chats[False])):
            length += args.turn_tokens
            print(f"| {t + 1} | {length} | {1e3 * on:.0f} ms | {cached} | {1e3 * off:.0f} ms | {a == b} |")
            length += len(a)
        first = [x[0] for x in chats[True]], [x[0] for x in chats[False]]
        print(f"turn {args.turns} / turn 1, time to first token: with the cache {first[0][-1] / first[0][0]:.2f}x "
              f"(target <= 1.5x), without {first[1][-1] / first[1][0]:.2f}x")
    if args.skip_load:
        return
    metrics = Metrics()
    backend = local_backend(model, metrics, max_batch_tokens=DEFAULT_BATCH_TOKENS, max_queue=4 * args.clients)
    with Server(model, backend, metrics, port=0) as server:
        asyncio.run(load(server.url, asks[:4], 4, 2))  # warm-up
        rounds = []
        for r in range(args.rounds):
            offline = generate(engine, [Request(f"{r}-{i}", p, args.tokens) for i, p in enumerate(asks)])
            cpu0 = thread_cpu_seconds(server._thread.native_id)
            wall, results = load_in_child(server.url, asks, args.clients, args.tokens)
            cpu = thread_cpu_seconds(server._thread.native_id) - cpu0
            rounds.append((offline, wall, results, cpu))
        print(f"\n{args.requests} requests ({args.prompt} prompt ids, {args.tokens} new tokens), {args.clients} "
              f"concurrent streaming clients, 125M Llama F32, one process, {args.rounds} rounds alternated")
        print("| round | offline tokens/s | serve tokens/s | serve / offline | server thread CPU ms/token |")
        print("|---|---|---|---|---|")
        ratios, per_token, steps = [], [], []
        for r, (offline, wall, results, cpu) in enumerate(rounds):
            tokens = sum(x["tokens"] for x in results)
            ratios.append((tokens / wall) / (offline.generated / offline.seconds))
            per_token.append(cpu / tokens)
            # a batched decode step, at most: the offline run's wall time over the fewest passes it
            # could have taken (every pass full, DEFAULT_BATCH_TOKENS rows)
            steps.append(offline.seconds / -(-offline.generated // DEFAULT_BATCH_TOKENS))
            print(f"| {r} | {offline.generated / offline.seconds:.1f} | {tokens / wall:.1f} | {ratios[-1]:.2f}x "
                  f"| {1e3 * per_token[-1]:.3f} |")
        results = [x for _, _, res, _ in rounds for x in res]
        ttft = [x["stamps"][0] - x["start"] for x in results if x["stamps"]]
        itl = [b - a for x in results for a, b in zip(x["stamps"], x["stamps"][1:])]
        overhead, step = float(np.median(per_token)), float(np.median(steps))
        print(f"median serve / offline {np.median(ratios):.2f}x (target >= 0.9x)")
        print(f"time to first token p50 {1e3 * pct(ttft, 0.5):.1f} ms, p99 {1e3 * pct(ttft, 0.99):.1f} ms; "
              f"inter-token p50 {1e3 * pct(itl, 0.5):.1f} ms, p99 {1e3 * pct(itl, 0.99):.1f} ms")
        print(f"server overhead per token {1e3 * overhead:.3f} ms (uvicorn's thread) against a batched decode step "
              f"of at most {1e3 * step:.1f} ms ({100 * overhead / step:.1f}%); per pass of "
              f"{DEFAULT_BATCH_TOKENS} tokens {100 * overhead * DEFAULT_BATCH_TOKENS / step:.1f}% of the step")
        if args.memory_requests:
            asyncio.run(short_requests(server.url, 200, args.clients, CFG.vocab))
            before = rss_mb()
            t0 = time.perf_counter()
            asyncio.run(short_requests(server.url, args.memory_requests, args.clients, CFG.vocab))
            after = rss_mb()
            print(f"memory over {args.memory_requests} requests ({time.perf_counter() - t0:.0f} s): RSS "
                  f"{before:.0f} -> {after:.0f} MB ({after - before:+.1f} MB)")


if __name__ == "__main__":
    main()
