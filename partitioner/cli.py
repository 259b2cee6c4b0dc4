"""``dist-runtime partition``: plan a model's pipeline stages and print (or save, or draw) it.

    dist-runtime partition MODEL --stages N | --budgets 8GiB,16GiB,... [--speeds 1,2,...]
        [--reserve 1GiB] --max-context 4096 --sessions 8 [--json] [--svg plan.svg] [-o plan.json]

The main CLI adds the command with :func:`register`; user errors are ``DistRuntimeError``s, which
it prints and turns into exit status 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dist_runtime.commands import add_kv_dtype, positive_int
from dist_runtime.errors import DistRuntimeError

from .machines import GRANULARITIES, make_machines


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``partition`` subcommand to an argparse ``subparsers`` object."""
    help_ = "Split a model into pipeline stages that fit each machine's memory, as fast as possible."
    p = subparsers.add_parser(
        "partition", help=help_,
        description=help_ + " The slowest stage (compute / speed) is minimised exactly, every stage "
        "fitting its budget (weights + KV cache at --max-context x --sessions + peak activations "
        "+ --reserve); ties go to the fewest bytes across cuts.",
    )
    p.add_argument("model", metavar="MODEL", help="path to a .model file with a graph")
    p.add_argument("--stages", type=positive_int, metavar="N",
                   help="number of stages (alone: machines without a memory limit)")
    p.add_argument("--budgets", metavar="SIZES",
                   help="memory budget per machine, in pipeline order, e.g. 8GiB,16GiB,16GiB")
    p.add_argument("--speeds", metavar="LIST", help="relative speed per machine, e.g. 1,2,1.5 (default: all 1)")
    p.add_argument("--reserve", default="0", metavar="SIZE",
                   help="memory kept free on each machine (headroom), e.g. 1GiB (default: 0)")
    p.add_argument("--max-context", type=positive_int, default=4096, metavar="TOKENS",
                   help="longest context a session may reach; sizes the KV caches (default: 4096)")
    p.add_argument("--sessions", type=positive_int, default=1, metavar="N",
                   help="sessions in flight, each with its own KV cache (default: 1)")
    p.add_argument("--microbatches", type=positive_int, default=1, metavar="N",
                   help="micro-batches in flight per stage; multiplies activations (default: 1)")
    p.add_argument("--tokens", type=positive_int, metavar="N",
                   help="rows of one call (a pass, a prompt's chunk) for activations and compute (default: for "
                        "a model with KV caches, the runtime's --max-batch-tokens default, 24; else --max-context)")
    add_kv_dtype(p, "the sessions' KV caches keep K and V in, which sizes them")
    p.add_argument("--granularity", choices=GRANULARITIES, default="auto",
                   help="cut between layers, anywhere, or between layers when the budgets allow (default: auto)")
    p.add_argument("--allow-empty", action="store_true", help="let a machine take no nodes")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("-o", "--out", metavar="PLAN.json", help="also write the plan as JSON to this file")
    p.add_argument("--svg", metavar="PLAN.svg", help="draw the plan: memory against budget, share of compute")
    p.set_defaults(func=cmd_partition)
    return p


def cmd_partition(args: argparse.Namespace) -> int:
    from dist_runtime.dtypes import kv_dtype
    from dist_runtime.model import load_model

    from .planner import partition
    from .svg import plan_svg

    if args.stages is None and not args.budgets:
        raise DistRuntimeError("give --stages N, or --budgets with one size per machine (e.g. 8GiB,16GiB)")
    machines = make_machines(args.stages, args.budgets, args.speeds, args.reserve)
    with load_model(args.model, tensors=[], validate=False) as model:
        if model.graph is None:
            raise DistRuntimeError(f"{args.model} has no graph section: there is nothing to partition")
        plan = partition(
            model.graph, machines, max_context=args.max_context, sessions=args.sessions,
            microbatches=args.microbatches, tokens=args.tokens, granularity=args.granularity,
            kv_dtype=kv_dtype(args.kv_dtype, model.metadata.get("kv_dtype")).name.lower(),
            allow_empty=args.allow_empty, model_name=str(model.metadata.get("name") or Path(args.model).name),
        )
    if args.out:
        Path(args.out).write_text(plan.to_json() + "\n")
    if args.svg:
        Path(args.svg).write_text(plan_svg(plan))
    if args.json:
        print(plan.to_json())
    else:
        print(plan.table())
        for what, path in (("plan", args.out), ("drawing", args.svg)):
            if path:
                print(f"wrote {what} to {path}")
    return 0
