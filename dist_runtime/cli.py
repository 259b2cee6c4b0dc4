"""The ``dist-runtime`` command line.

Exit status: 0 success, 1 a model that is malformed or invalid (the message says what and where),
2 a usage error.  Every command that reports takes ``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import DistRuntimeError
from .units import format_bytes, parse_bytes


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# -- inspect / validate -------------------------------------------------------------------------
def _report(path: str, max_memory: int | None) -> dict:
    """Load and validate ``path``; everything inspect and validate print, as one dict."""
    from .ir.validate import estimate_memory, infer_shapes
    from .model import load_model

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
        from .ir.text_form import format_graph
        from .ir.validate import validate_graph

        limit = max_memory if max_memory is not None else model.metadata.get("max_memory")
        report["warnings"] = validate_graph(graph, max_memory=limit)
        specs = infer_shapes(graph)
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


def cmd_inspect(args: argparse.Namespace) -> int:
    report = _report(args.model, args.max_memory)
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
    from .examples import LlamaConfig, llama_graph, llama_metadata, llama_weights
    from .model import save_model

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
        p.add_argument("--max-memory", type=_size, metavar="SIZE",
                       help="check the memory estimate against SIZE (e.g. 8GiB) instead of the "
                            "model's declared max_memory")
        p.set_defaults(func=func)
        return p

    model_command("inspect", "Show a model's metadata, tensors, graph (one line per node, with "
                  "inferred shapes), memory estimate and validation warnings.", cmd_inspect)
    model_command("validate", "Check a model file and its graph; exit 0 if valid, 1 with a "
                  "message naming the problem otherwise.", cmd_validate)

    ex = sub.add_parser("example", help="Write a small random-weight Llama-architecture model.",
                        description="Write a small random-weight Llama-architecture model "
                                    "(seeded; Hugging Face weight names).")
    ex.add_argument("-o", "--out", default="out/tiny-llama.model", help="output path (default: %(default)s)")
    for flag, default in (("vocab", 256), ("hidden", 64), ("layers", 2), ("heads", 4),
                          ("kv-heads", 2), ("ffn", 128), ("seed", 0)):
        ex.add_argument(f"--{flag}", type=int, default=default, help=f"(default: {default})")
    ex.set_defaults(func=cmd_example)

    from partitioner.cli import register as register_partition

    register_partition(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DistRuntimeError as e:
        if getattr(args, "json", False):
            print(json.dumps({"valid": False, "error": type(e).__name__, "message": str(e)}, indent=2))
        else:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: cannot open {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
