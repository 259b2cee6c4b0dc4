"""``dist-runtime generate`` and ``dist-runtime pipeline``: one generation command.

Both build the same :class:`~dist_runtime.engine.Request` list (session ``i`` samples with seed
``seed + i``) and run it through :func:`~dist_runtime.engine.generate` on an engine: this
process (``LocalEngine``), or the model split into stages on Ray (the pipeline's coordinator) when
``--stages``, ``--budgets`` or ``--plan`` is given.  ``pipeline`` is the same command with the
stages required and its historical flag names (``--prompt-ids``, ``--max-new-tokens``); both print
the same output and the same ``--json`` schema.

Ctrl-C stops the run: the pipeline is closed (stage actors killed, an embedded Ray stopped), a
one-line note goes to stderr and the exit status is 130, with no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys

from ..commands import USAGE, add_kv_dtype, add_numerics, check_signals, positive_int, token_ids
from ..errors import DistRuntimeError, SamplingError
from ..pipeline.options import add_deployment_options, wants_pipeline
from ..scheduling_defaults import DEFAULT_BATCH_TOKENS


def register(sub) -> None:
    gen = sub.add_parser("generate", help="Generate tokens with a model, in this process or split into "
                         "pipeline stages, streaming them.",
                         description="Generate tokens with a model, printing each as it comes (one session) "
                                     "or each session's result as it ends (several); a tokens/s summary goes "
                                     "to stderr. Greedy unless a sampling option is given; filters apply in "
                                     "the order temperature, top-k, top-p, min-p. With --stages, --budgets "
                                     "or --plan the model runs split into pipeline stages on Ray.")
    gen.add_argument("model", metavar="MODEL", help="path to a .model file")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the model's tokenizer)")
    what.add_argument("--ids", type=token_ids, metavar="1,2,3", help="prompt token ids, comma-separated")
    gen.add_argument("-n", "--max-tokens", type=positive_int, default=64, help="tokens to generate (default: %(default)s)")
    _common(gen)
    gen.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json (or a directory holding one) "
                     "instead of the one convert stored beside the model")
    gen.add_argument("--show-ids", action="store_true", help="print token ids even when there is a tokenizer")
    add_deployment_options(gen)
    gen.set_defaults(func=cmd_generate)

    help_ = "Generate with the model split into pipeline stages, one Ray actor per stage."
    pipe = sub.add_parser("pipeline", help=help_, description=help_ + " The same run as `generate --stages`, "
                          "with the prompt given as ids.")
    pipe.add_argument("model", metavar="MODEL", help="path to a .model file with a graph (the driver's path)")
    pipe.add_argument("--prompt-ids", dest="ids", type=token_ids, default=[1], metavar="IDS",
                      help="prompt token ids, e.g. 1,2,3 (default: 1)")
    pipe.add_argument("--max-new-tokens", dest="max_tokens", type=positive_int, default=16, metavar="N",
                      help="(default: 16)")
    _common(pipe)
    pipe.add_argument("--stream", action="store_true", help="print every token as it arrives, one line each")
    add_deployment_options(pipe)
    pipe.set_defaults(func=cmd_generate, prompt=None, tokenizer=None, show_ids=True)


def _common(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sampling (dist_runtime/sampling.py)")
    s.add_argument("--greedy", action="store_true", help="always take the most likely token (the default)")
    s.add_argument("--temperature", type=float, help="sample at this temperature (0: greedy; default 1 when "
                                                     "a filter is given)")
    s.add_argument("--top-k", type=int, help="sample among the K most likely tokens")
    s.add_argument("--top-p", type=float, help="sample from the smallest set with probability >= P")
    s.add_argument("--min-p", type=float, help="drop tokens less likely than P x the most likely one")
    s.add_argument("--seed", type=int, help="seed of the first session's sampler; session i uses seed + i "
                                            "(default: a fresh seed, printed with --json)")
    p.add_argument("--sessions", type=positive_int, default=1, metavar="K",
                   help="sessions generating at once from the prompt (default: 1)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--max-batch-tokens", type=positive_int, default=DEFAULT_BATCH_TOKENS, metavar="N",
                   help="rows of one pass: every decoding session's next token, then chunks of prompts "
                        "(default: %(default)s, measured: a long prompt must not stall the others)")
    p.add_argument("--no-fuse", action="store_true", help="run without the fusion pre-pass")
    add_kv_dtype(p)
    add_numerics(p)
    p.add_argument("--stats", action="store_true", help="print the memory (each stage's beside its plan's "
                                                        "estimate) and, with stages, the per-stage timing table")
    p.add_argument("--json", action="store_true", help="print one JSON result at the end instead of streaming")


def cmd_generate(args: argparse.Namespace) -> int:
    from ..sampling import Sampling

    try:
        sampling = Sampling.from_options(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                                         top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    except SamplingError as e:
        print(f"dist-runtime {args.command}: error: {e}", file=sys.stderr)
        return USAGE
    if args.command == "pipeline" and not wants_pipeline(args):
        raise DistRuntimeError("give --stages N, --budgets (one size per stage) or --plan PLAN.json")
    if wants_pipeline(args):
        _check_before_ray(args)
    job = _Job.open(args, sampling)
    if wants_pipeline(args):
        return _run_on_pipeline(args, job)
    from ..engine import LocalEngine, kv_pool_rows
    from ..executor import GraphExecutor

    executor = GraphExecutor(args.model, fuse=not args.no_fuse, kv_dtype=args.kv_dtype, numerics=args.numerics)
    result = job.run(LocalEngine(executor, max_batch_tokens=args.max_batch_tokens, max_kv_rows=kv_pool_rows(executor)))
    return job.report(result, None, executor.memory())


def _size(n: int | None) -> str:
    from ..units import format_bytes

    return "?" if n is None else format_bytes(n)


def _memory_line(m: dict) -> str:
    """One line of a process's memory (``GraphExecutor.memory``, or a stage's with its plan's estimate)."""
    line = (f"resident {_size(m.get('resident'))} (peak {_size(m.get('peak'))}), KV in use "
            f"{_size(m['kv_in_use'])} of {_size(m['kv_reserved'])} reserved")
    if "weights" in m:
        line += f", weights {_size(m['weights'])}"
    plan = m.get("plan")
    if plan:
        line += (f"; planned {_size(plan['total'])} (weights {_size(plan['weights'])}, KV {_size(plan['kv'])}, "
                 f"activations {_size(plan['activations'])})")
    return line


class _Job:
    """The requests of one command, the tokenizer that prints them, and how they are printed."""

    def __init__(self, args, requests, tokenizer) -> None:
        self.args, self.requests, self.tokenizer = args, requests, tokenizer
        self.live = len(requests) == 1 and not args.json and not getattr(args, "stream", False)
        self.decoder = None

    @classmethod
    def open(cls, args, sampling) -> _Job:
        from ..engine import Request, check_requests, generative_io, stop_ids
        from ..model import load_model

        with load_model(args.model, tensors=[]) as model:
            metadata = model.metadata
            if model.graph is None:
                raise DistRuntimeError(f"{args.model} has no graph section: there is nothing to run")
            generative_io(model.graph)
        tokenizer = _tokenizer(args, metadata)
        prompt = args.ids if args.ids is not None else tokenizer.encode(args.prompt)
        stop = frozenset() if args.ignore_eos else stop_ids(metadata)
        requests = [Request(i, prompt, args.max_tokens, sampling.with_seed(sampling.seed + i), stop)
                    for i in range(args.sessions)]
        config = metadata.get("config", {})
        context = config.get("context_length")
        if wants_pipeline(args) and args.max_context:
            context = min(context or args.max_context, args.max_context)
        check_requests(requests, vocab=config.get("vocab"), context=context)
        return cls(args, requests, tokenizer)

    def run(self, engine, **stream_options):
        from ..engine import generate

        if self.live and self.tokenizer is not None and not self.args.show_ids:
            from ..importers.tokenizer import StreamDecoder

            self.decoder = StreamDecoder(self.tokenizer)
        return generate(engine, self.requests, on_event=self._on_event, **stream_options)

    def _on_event(self, event) -> None:
        check_signals()  # a Ctrl-C lost in a callback from C (a kernel compiling) stops here
        if event.token is None:
            return
        if getattr(self.args, "stream", False) and not self.args.json:
            print(f"session {event.session}: {event.token}", flush=True)
        elif self.live:
            text = self.decoder.add(event.token) if self.decoder else ("" if event.index == 0 else " ") + str(event.token)
            print(text, end="", flush=True)

    def text(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    def report(self, result, pipeline: dict | None, memory: dict | None = None) -> int:
        args = self.args
        check = pipeline.get("check") if pipeline else None
        code = 0 if check in (None, True) and all(s.error is None for s in result.sessions) else 1
        if args.json:
            sessions = [s.to_json() | {"text": self.text(s.ids)} for s in result.sessions]
            print(json.dumps({"model": args.model, "prompt": self.requests[0].prompt, "sampling":
                              self.requests[0].sampling.describe(), "sessions": sessions,
                              "generated_tokens": result.generated, "seconds": result.seconds,
                              "tokens_per_second": result.generated / result.seconds if result.seconds else None,
                              "pipeline": pipeline and {k: v for k, v in pipeline.items() if k != "table"},
                              "memory": memory},
                             indent=2, default=str))
            return code
        if self.live:
            print((self.decoder.finish() if self.decoder else "") + "\n", end="", flush=True)
        else:
            for s in result.sessions:
                shown = ",".join(map(str, s.ids)) if args.show_ids or self.tokenizer is None else self.text(s.ids)
                print(f"session {s.session}: {shown}")
        for s in result.sessions:
            if s.error is not None:
                print(f"error: session {s.session}: {type(s.error).__name__}: {s.error}", file=sys.stderr)
        if pipeline:
            _print_pipeline(args, pipeline)
        if memory and args.stats:
            print(f"memory: {_memory_line(memory)}")
        print(_summary(result), file=sys.stderr)
        return code


def _tokenizer(args, metadata):
    """The model's tokenizer (None if it has none and the prompt is ids); a text prompt needs one."""
    from ..importers.tokenizer import Tokenizer, find_tokenizer

    path = find_tokenizer(args.model, metadata, args.tokenizer)
    if path is None:
        if args.prompt is not None:
            raise DistRuntimeError(f"{args.model} has no tokenizer (convert copies HF_DIR/tokenizer.json "
                                   f"beside the model); pass --tokenizer PATH or --ids")
        return None
    try:
        return Tokenizer(path)
    except DistRuntimeError as e:
        if args.prompt is not None:
            raise
        print(f"note: printing ids: {e}", file=sys.stderr)  # --ids works without the tokenizers package
        return None


def _summary(result) -> str:
    if len(result.sessions) == 1:
        s = result.sessions[0]
        # The first token's time includes the prompt's prefill (and, on a cold cache, compiling):
        # the rate is the decode after it, said so, since "8 tokens in 88 s, 2152 tokens/s" misleads.
        rate = f"{s.tokens_per_second:.1f} tokens/s after the first" if s.tokens_per_second else "-"
        first = f"{s.first_token_seconds * 1e3:.1f} ms" if s.first_token_seconds is not None else "-"
        return (f"[prompt {len(s.prompt)} tokens, first token in {first}; generated {len(s.ids)} tokens in "
                f"{result.seconds:.2f} s, {rate}{'; stopped at EOS' if s.finish_reason == 'stop' else ''}]")
    rate = f"{result.generated / result.seconds:.1f} tokens/s" if result.seconds else "-"
    return f"[{len(result.sessions)} sessions: generated {result.generated} tokens in {result.seconds:.2f} s, {rate}]"


def _run_on_pipeline(args, job: _Job) -> int:
    from ..pipeline.cluster import describe
    from ..pipeline.launch import open_pipeline

    pipe = open_pipeline(args, len(job.requests))
    try:
        result = job.run(pipe.coordinator, max_in_flight=args.max_in_flight, max_batch_tokens=args.max_batch_tokens)
        run = pipe.coordinator.last_run
        if args.timeline:
            with open(args.timeline, "w") as f:
                f.write(run.svg())
        if args.trace:
            with open(args.trace, "w") as f:
                json.dump(run.trace(), f)
        pipeline = {"plan_hash": pipe.plan.hash, "stages": pipe.reports, "memory": pipe.memory(),
                    "nodes": describe()["nodes"],
                    "stats": run.summary(), "table": run.table(), "timeline": args.timeline, "trace": args.trace,
                    "micro_batches": pipe.micro_batches, "micro_batches_reason": pipe.micro_batches_reason,
                    "threads": pipe.threads, "threads_reason": pipe.threads_reason,
                    "batching": pipe.coordinator.batching or "the rows of several sessions share each pass",
                    "check": None}
    except KeyboardInterrupt:
        with _no_sigint():  # a second Ctrl-C must not cut the teardown short
            pipe.close()
        raise
    finally:
        pipe.close()  # idempotent: a no-op after the close above
    if args.check:
        from ..engine import LocalEngine, generate
        from ..executor import GraphExecutor

        reference = generate(LocalEngine(GraphExecutor(args.model, fuse=not args.no_fuse, kv_dtype=args.kv_dtype, numerics=args.numerics)),
                             job.requests)
        pipeline["check"] = reference.tokens == result.tokens
    return job.report(result, pipeline)


def _print_pipeline(args, pipeline: dict) -> None:
    if args.stats:
        print()
        for r in pipeline["stages"]:
            print(f"stage {r['stage']}: {r['host']} pid {r['pid']}, {len(r['weights'])} weights "
                  f"({r['weight_bytes']:,} bytes) from {r['source']}, {pipeline['threads'][r['stage']]} compute "
                  f"thread(s)")
        for k, m in enumerate(pipeline["memory"]):
            print(f"stage {k} memory: {_memory_line(m)}")
        print(pipeline["table"])
        print(f"batching: {pipeline['batching']}; {pipeline['micro_batches']} micro-batch(es) in flight "
              f"({pipeline['micro_batches_reason']}); threads per stage {pipeline['threads']} "
              f"({pipeline['threads_reason']})")
    if pipeline["timeline"]:
        print(f"wrote timeline to {pipeline['timeline']}")
    if pipeline["trace"]:
        print(f"wrote trace to {pipeline['trace']} (open in https://ui.perfetto.dev)")
    if pipeline["check"] is not None:
        print("check: the same tokens as one process" if pipeline["check"]
              else "check: FAILED, tokens differ from one process")


def _check_before_ray(args) -> None:
    """What can be refused before Ray starts (which takes seconds): every session must fit a stage,
    and the timeline must be writable (not found out after the run, with its tokens lost)."""
    from ..pipeline.options import MAX_SESSIONS

    if args.sessions > MAX_SESSIONS:
        raise DistRuntimeError(f"--sessions {args.sessions}: a stage holds at most {MAX_SESSIONS} sessions")
    for option, path in (("--timeline", args.timeline), ("--trace", args.trace)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise DistRuntimeError(f"{option} {path}: cannot write a file there "
                                       f"({'a directory' if os.path.isdir(path) else 'no writable folder ' + folder})")


@contextlib.contextmanager
def _no_sigint():
    """Ignore further Ctrl-Cs while the pipeline is torn down; restores the handler afterwards."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
