"""``dist-runtime serve``: the command line of the server (argparse only at import: ``--help``
imports neither numpy, Ray nor FastAPI)."""

from __future__ import annotations

import argparse
import os

from ..commands import add_kv_dtype, add_numerics, port, positive_float, positive_int, size
from ..pipeline.options import MAX_SESSIONS, add_deployment_options, wants_pipeline
from ..scheduling_defaults import DEFAULT_BATCH_TOKENS, DEFAULT_PREFIX_CACHE

API_KEY_ENV = "DIST_RUNTIME_API_KEY"


def register(sub) -> None:
    help_ = "Serve a model over an OpenAI-compatible HTTP API (completions, chat, embeddings, streaming)."
    sv = sub.add_parser("serve", help=help_, description=help_ + " Requests join the running batch as they "
                        "come; with --stages, --budgets or --plan the model runs split into pipeline stages "
                        "on Ray. A web page at / tries it out. See docs/serving.md.")
    sv.add_argument("model", metavar="MODEL", help="path to a .model file (a generative model or a "
                                                   "sentence-transformers encoder)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s: this "
                                                        "machine only)")
    sv.add_argument("--port", type=port, default=8000, help="port (default: %(default)s; 0: any free one, printed)")
    sv.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (default: the "
                                                    f"{API_KEY_ENV} environment variable, else no key)")
    sv.add_argument("--name", default=None, help="the model's name in the API (default: the file's name "
                                                 "without .model)")
    sv.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json, or a directory holding it and "
                                                        "tokenizer_config.json (default: the one beside the model)")
    sv.add_argument("--chat-template", metavar="FILE", help="a .jinja chat template or a tokenizer_config.json "
                                                            "(default: one beside the tokenizer)")
    sv.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                    help="sessions running or queued at most; beyond, 429 with Retry-After (default: %(default)s)")
    sv.add_argument("--max-batch-tokens", type=positive_int, default=DEFAULT_BATCH_TOKENS, metavar="N",
                    help="rows of one pass: every decoding session's next token, then chunks of prompts "
                         "(default: %(default)s)")
    sv.add_argument("--keep-alive", type=positive_float, default=10.0, metavar="SECONDS",
                    help="SSE comment interval while a stream waits for a token (default: %(default)g)")
    sv.add_argument("--no-fuse", action="store_true", help="run without the fusion pre-pass")
    add_kv_dtype(sv)
    add_numerics(sv)
    sv.add_argument("--prefix-cache", type=size, metavar="SIZE",
                    help="KV rows of ended requests kept for new ones whose prompt begins with the same "
                         "tokens (a conversation's next turn, a shared system prompt), least recently used "
                         f"evicted past SIZE; 0 turns it off (default: {DEFAULT_PREFIX_CACHE} in this process; "
                         "none on stages, where SIZE a stage is memory beyond its plan: give it as --reserve)")
    add_deployment_options(sv)
    sv.set_defaults(func=cmd_serve)

    help_ = "Drain a node of a served pipeline: its stages move to the other nodes, no request is lost."
    dr = sub.add_parser("drain", help=help_, description=help_ + " The server re-plans the pipeline over its "
                        "other nodes once the passes in flight are back, replays every session onto the new "
                        "stages and goes on; the node is not planned onto again. Without NODE, lists the "
                        "stages and their nodes. See docs/cluster.md.")
    dr.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    dr.add_argument("node", metavar="NODE", nargs="?", help="the Ray node id to drain, or its first characters")
    dr.add_argument("--api-key", default=None, help=f"the server's key (default: the {API_KEY_ENV} environment "
                                                    f"variable)")
    dr.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                    help="longest wait for the drain (default: %(default)g)")
    dr.set_defaults(func=cmd_drain)


def cmd_drain(args: argparse.Namespace) -> int:
    import httpx

    from ..errors import DistRuntimeError

    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.url.rstrip("/")
    try:
        if args.node is None:
            r = httpx.get(f"{base}/admin/pipeline", headers=headers, timeout=args.timeout)
        else:
            r = httpx.post(f"{base}/admin/drain", json={"node": args.node}, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as e:
        raise DistRuntimeError(f"{base}: {type(e).__name__}: {e}") from None
    try:
        body = r.json()
    except ValueError:
        raise DistRuntimeError(f"{base} answered {r.status_code} without JSON: is it a dist-runtime server?") from None
    if r.status_code != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        raise DistRuntimeError(f"{base}: {message or f'status {r.status_code}'}")
    if args.node is None:
        for st in body["stages"]:
            print(f"stage {st['stage']}: node {st['node']} ({st['host']})")
        return 0
    seconds = ", ".join(f"{k} {v:.2f} s" for k, v in body["seconds"].items())
    print(f"drained {args.node}: {len(body['old'])} stage(s) -> {len(body['new'])} on "
          f"{', '.join(st['node'] for st in body['new'])}; {seconds}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .metrics import Metrics
    from .served_model import ServedModel
    from .server import PipelineAdmin, Server, local_backend, pipeline_backend, pipeline_health

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    model = ServedModel.open(args.model, context=args.max_context, tokenizer=args.tokenizer,
                             chat_template=args.chat_template, name=args.name)
    if wants_pipeline(args):
        from ..pipeline.launch import context_limit, open_pipeline

        if args.max_context is None:  # the stages' KV caches are sized for what the Pipeline plans
            model.context = context_limit(model.metadata)
        metrics = Metrics(max_length=model.context)
        pipe = open_pipeline(args, min(args.max_queue, MAX_SESSIONS))
        pipe.coordinator.set_prefix_cache(args.prefix_cache or 0)
        try:
            backend = pipeline_backend(model, pipe, metrics, max_queue=args.max_queue,
                                       max_in_flight=args.max_in_flight)
            server = Server(model, backend, metrics, host=args.host, port=args.port, api_key=api_key,
                            keep_alive=args.keep_alive, health=pipeline_health(pipe), on_close=pipe.close,
                            admin=PipelineAdmin(pipe))
        except BaseException:
            pipe.close()
            raise
        where = f"{len(pipe.stages)} pipeline stages"
    else:
        metrics = Metrics(max_length=model.context)
        backend = local_backend(model, metrics, max_batch_tokens=args.max_batch_tokens,
                                max_queue=args.max_queue, fuse=not args.no_fuse, kv_dtype=args.kv_dtype,
                                numerics=args.numerics, prefix_cache=args.prefix_cache)
        server = Server(model, backend, metrics, host=args.host, port=args.port, api_key=api_key,
                        keep_alive=args.keep_alive)
        where = "this process"
    what = "embeddings" if model.kind == "embed" else "completions" + (", chat" if model.chat_template else "")
    print(f"serving {model.id!r} ({what}) on {where} at {server.url}/v1"
          f"{' (API key required)' if api_key else ''}; web page at {server.url}/", flush=True)
    server.serve()
    return 0

