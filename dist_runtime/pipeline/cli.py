"""``dist-runtime pipeline``: generate with a model split into stages on Ray.

    dist-runtime pipeline MODEL --stages N | --budgets 8GiB,16GiB [--sessions K]
        [--prompt-ids 1,2,3] [--max-new-tokens N] [--temperature T --top-k K | --top-p P | --min-p P]
        [--timeline t.svg] [--stats] [--address auto] [--channel chain|compiled] [--check]

The main CLI adds the command with :func:`register`; :func:`main` runs it standalone (the cluster
job script uses it).  Without ``--address`` or ``RAY_ADDRESS`` an embedded local Ray is started and
stopped; with them the command joins the cluster.

Ctrl-C (SIGINT) stops the run: the pipeline is closed (stage actors killed, the embedded Ray
stopped), a one-line note goes to stderr and the exit status is 130, with no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path

from dist_runtime.partitioner.cli import positive_int

from ..errors import DistRuntimeError
from .channels import CHANNELS, DEFAULT_CHANNEL
from .deploy import WEIGHT_SOURCES


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError("give at least one token id, each >= 0")
    return ids


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="path to a .model file with a graph (the driver's path)")
    plan = p.add_argument_group("plan")
    plan.add_argument("--stages", type=positive_int, metavar="N", help="number of stages (machines without a memory limit)")
    plan.add_argument("--budgets", metavar="SIZES", help="memory budget per stage, in pipeline order, e.g. 8GiB,16GiB")
    plan.add_argument("--speeds", metavar="LIST", help="relative speed per stage, e.g. 1,2 (default: all 1)")
    plan.add_argument("--reserve", default="0", metavar="SIZE", help="memory kept free per machine (default: 0)")
    plan.add_argument("--max-context", type=positive_int, default=None, metavar="TOKENS",
                      help="longest context a session may reach; sizes the KV caches in the plan "
                           "(default: the model's context length, at most 4096)")
    plan.add_argument("--plan", metavar="PLAN.json", help="use a plan from `dist-runtime partition -o` instead")
    gen = p.add_argument_group("generation")
    gen.add_argument("--sessions", type=positive_int, default=1, metavar="K",
                     help="sessions generating at once, all from the prompt (seeds seed, seed+1, ...) (default: 1)")
    gen.add_argument("--max-in-flight", type=positive_int, metavar="N",
                     help="sessions with a step in the pipeline at once (default: all of them)")
    gen.add_argument("--prompt-ids", type=_ids, default=[1], metavar="IDS", help="prompt token ids, e.g. 1,2,3 (default: 1)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=16, metavar="N", help="(default: 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed of the first session (default: 0)")
    gen.add_argument("--stream", action="store_true", help="print every token as it arrives")
    gen.add_argument("--check", action="store_true",
                     help="also run the requests in one process (GraphExecutor) and compare the tokens")
    run = p.add_argument_group("cluster")
    run.add_argument("--address", metavar="ADDR",
                     help="an existing Ray cluster ('auto', or host:port; default: RAY_ADDRESS, else an embedded local Ray)")
    run.add_argument("--num-cpus", type=positive_int, metavar="N", help="CPUs of the embedded local Ray (default: all)")
    run.add_argument("--channel", choices=CHANNELS, default=DEFAULT_CHANNEL,
                     help="how steps travel between stages (default: %(default)s; see docs/cluster.md)")
    run.add_argument("--weights", choices=WEIGHT_SOURCES, default="auto",
                     help="auto: map the file where it exists on a node, else send the stage's tensors "
                          "through the object store (default: auto)")
    run.add_argument("--worker-path", metavar="PATH", help="where the workers find the model (default: MODEL, absolute)")
    run.add_argument("--cpus-per-stage", type=float, metavar="N", help="CPU reservation per stage (default: shared evenly)")
    run.add_argument("--threads-per-stage", type=positive_int, metavar="N",
                     help="BLAS threads per stage (default: its CPUs). With one session at a time the "
                          "stages take turns: give each the machine's cores (idle stages' threads then "
                          "sleep); with many sessions keep the default share")
    run.add_argument("--stage-resources", metavar="NAMES",
                     help="pin stage k to the node with resource NAME_k, e.g. node:10.0.0.11,node:10.0.0.12 "
                          "(Ray's per-node resource) or custom ones like stage0,stage1")
    run.add_argument("--no-fuse", action="store_true", help="run the stages without the fusion pre-pass")
    run.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                     help="longest wait for one step's reply before the run fails (default: 600; a dead "
                          "stage is noticed at once)")
    out = p.add_argument_group("output")
    out.add_argument("--stats", action="store_true", help="print the per-stage timing table and run figures")
    out.add_argument("--timeline", metavar="FILE.svg", help="draw the per-stage timeline (who was busy when)")
    out.add_argument("--json", action="store_true", help="print everything as JSON")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``pipeline`` subcommand to an argparse ``subparsers`` object."""
    help_ = "Generate with the model split into pipeline stages, one Ray actor per stage."
    p = subparsers.add_parser("pipeline", help=help_, description=help_)
    add_arguments(p)
    p.set_defaults(func=run_pipeline_generate)
    return p


def _requests(args):
    from .coordinator import Request
    from .sampling import Sampling

    try:
        return [Request(session=i, prompt=args.prompt_ids, max_new_tokens=args.max_new_tokens,
                        sampling=Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.seed + i))
                for i in range(args.sessions)]
    except ValueError as e:
        raise DistRuntimeError(str(e)) from None


def _options(args):
    from .deploy import StageOptions

    resources = None
    if args.stage_resources:
        names = [n.strip() for n in args.stage_resources.split(",") if n.strip()]
        resources = [{n: 0.001} for n in names]  # a sliver: several stages may share a node
    return StageOptions(cpus=args.cpus_per_stage, threads=args.threads_per_stage, resources=resources,
                        weights=args.weights, worker_path=args.worker_path, fuse=not args.no_fuse)


def run_pipeline_generate(args: argparse.Namespace) -> int:
    """The ``pipeline`` command: plan, deploy, generate, report.  Ctrl-C: see the module docstring."""
    try:
        return _run_pipeline_generate(args)
    except KeyboardInterrupt:
        # By now the pipeline is closed (actors killed, Ray stopped if this command started it):
        # _run_pipeline_generate closes it before the interrupt reaches here.
        from ..cli import INTERRUPTED

        print("dist-runtime pipeline: interrupted; the pipeline was shut down", file=sys.stderr, flush=True)
        return INTERRUPTED


@contextlib.contextmanager
def _no_sigint():
    """Ignore further Ctrl-Cs while the pipeline is torn down (a second one would cut ``close``
    short and leave actors or an embedded Ray behind); restores the handler afterwards."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_pipeline_generate(args: argparse.Namespace) -> int:
    from .cluster import describe
    from .launch import Pipeline

    if args.stages is None and not args.budgets and not args.plan:
        raise DistRuntimeError("give --stages N, --budgets (one size per stage) or --plan PLAN.json")
    plan = None
    if args.plan:
        from dist_runtime.partitioner.plan import Plan

        plan = Plan.from_json(Path(args.plan).read_text())
    requests = _requests(args)
    pipe = Pipeline(args.model, plan=plan, stages=args.stages, budgets=args.budgets, speeds=args.speeds,
                    reserve=args.reserve, max_context=args.max_context, sessions=args.sessions,
                    channel=args.channel, options=_options(args), address=args.address,
                    num_cpus=args.num_cpus, timeout=args.timeout)
    try:
        tokens: dict = {}
        # closing(): on an exception (Ctrl-C included) the stream is finished here, while the
        # actors and Ray are still up -- not later by the garbage collector, after Ray is gone.
        with contextlib.closing(pipe.coordinator.stream(requests, max_in_flight=args.max_in_flight)) as events:
            for event in events:
                if event.error is not None:
                    raise event.error
                tokens.setdefault(event.session, []).append(event.token)
                if args.stream and not args.json:
                    print(f"session {event.session}: {event.token}", flush=True)
        run = pipe.coordinator.last_run
        reports, plan_hash = pipe.reports, pipe.plan.hash
        nodes = describe()["nodes"]
        if args.timeline:
            Path(args.timeline).write_text(run.svg())
    except KeyboardInterrupt:
        with _no_sigint():
            pipe.close()
        raise
    finally:
        pipe.close()  # idempotent: a no-op after the close above
    check = None
    if args.check:
        check = _check(args, requests, tokens)
    if args.json:
        print(json.dumps({"tokens": {str(k): v for k, v in tokens.items()}, "plan_hash": plan_hash,
                          "stages": reports, "nodes": nodes, "stats": run.summary(), "check": check},
                         indent=2, default=str))
        return 0 if check in (None, True) else 1
    for sid, ids in tokens.items():
        print(f"session {sid}: {','.join(map(str, ids))}")
    if args.stats:
        print()
        for r in reports:
            print(f"stage {r['stage']}: {r['host']} pid {r['pid']}, {len(r['weights'])} weights "
                  f"({r['weight_bytes']:,} bytes) from {r['source']}, {r['threads']} BLAS thread(s)")
        print(run.table())
    if args.timeline:
        print(f"wrote timeline to {args.timeline}")
    if check is not None:
        print("check: the same tokens as one process" if check else "check: FAILED, tokens differ from one process")
    return 0 if check in (None, True) else 1


def _check(args, requests, tokens) -> bool:
    from ..executor import GraphExecutor
    from .reference import reference_tokens

    executor = GraphExecutor(args.model, fuse=not args.no_fuse)
    return reference_tokens(executor, requests) == tokens


def build_parser(prog: str = "dist-runtime pipeline") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Generate with the model split into pipeline "
                                "stages, one Ray actor per stage.")
    add_arguments(p)
    return p


def main(argv: list[str] | None = None, prog: str = "dist-runtime pipeline") -> int:
    """Run the command standalone (the cluster job script); exit status as the main CLI's."""
    from ..cli import run_command

    return run_command(run_pipeline_generate, build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
