"""One generation interface for one process and a pipeline alike.

A :class:`Request` asks for up to ``max_new_tokens`` after a prompt, with its own
:class:`~dist_runtime.sampling.Sampling`; an *engine* turns requests into a stream of
:class:`TokenEvent`.  Two engines exist: :class:`LocalEngine` (one ``GraphExecutor`` in this
process) and the pipeline's ``Coordinator`` (stages on Ray).  Both interleave sessions step by step
and sample on the driver with each session's own seeded generator, so the same requests give the
same tokens on either.  :func:`generate` runs requests on an engine and times them; the command
line, the demo and the tests call it, never each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from .batched_pass import Segment
from .errors import DistRuntimeError
from .ir.graph import Graph
from .ir.ops import Sample
from .requests import Inbox, Request, TokenEvent, check_requests  # noqa: F401 -- the engines' vocabulary, here too
from .scheduling import Scheduler, Work
from .scheduling_defaults import DEFAULT_BATCH_TOKENS


class Engine(Protocol):
    def stream(self, requests: Iterable[Request]) -> Iterator[TokenEvent]: ...


def driver_outputs(graph: Graph) -> tuple[list[str], str | None]:
    """(outputs a pass returns to the driver, the logits name) once the graph's Sample nodes are
    dropped: every engine samples on the driver, per session, with the session's own settings.

    The outputs are the graph's outputs minus those of Sample nodes, plus the logits a Sample
    node reads when they are not an output already.
    """
    sampled = {out for node in graph.nodes if isinstance(node.op, Sample) for out in node.outputs}
    logits = next((node.inputs[0] for node in graph.nodes if isinstance(node.op, Sample)), None)
    outputs = [o for o in graph.outputs if o not in sampled]
    if logits is not None and logits not in outputs:
        outputs.append(logits)
    if logits is None and "logits" in outputs:
        logits = "logits"
    return outputs, logits


def generative_io(graph: Graph) -> tuple[str, str]:
    """(token input, logits output) of a graph that can generate; a ``DistRuntimeError`` saying
    what to do instead for one that cannot (an encoder)."""
    _, logits = driver_outputs(graph)
    names = graph.input_names
    if logits is None or len(names) != 1:
        raise DistRuntimeError(f"this graph cannot generate: it needs one token input and a 'logits' output "
                               f"(inputs {names}, outputs {graph.outputs}); for sentence embeddings use "
                               f"`dist-runtime embed`")
    return names[0], logits


def kv_pool_rows(executor, held_back: int = 0, share: float = 0.8) -> int | None:
    """The KV rows this process's sessions may hold at once: ``share`` of the memory the system
    has available now (weights loaded), less ``held_back`` bytes (a prefix cache's budget), over
    the bytes a row takes in every cache; None where the memory cannot be read."""
    from .arena import available_memory

    available, per_row = available_memory(), executor.kv_row_bytes()
    if available is None or not per_row:
        return None
    return max(0, int(available * share) - held_back) // per_row


class LocalEngine:
    """Requests on one ``GraphExecutor`` in this process, continuously batched: each pass carries
    a row of every decoding session and chunks of new prompts (:mod:`dist_runtime.scheduling`).
    The executor should be batch-invariant (``executor.batch_invariant``, the numba backend) so that a session's tokens
    do not depend on its company."""

    def __init__(self, executor, *, max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_sessions: int | None = None, prefix_cache=None, max_kv_rows: int | None = None) -> None:
        self.executor = executor
        # The KV rows the sessions may hold at once (kv_pool_rows: what this machine's memory
        # holds): a request beyond what is free waits, one that could never fit fails alone.
        self.max_kv_rows = max_kv_rows
        # A PrefixCache: a session that ends leaves its KV rows there, a new request whose prompt
        # begins with them starts from a copy (dist_runtime/prefix_cache.py).
        self.prefix_cache = prefix_cache
        self._fed: dict[Hashable, list[int]] = {}  # each session's tokens whose KV rows it holds or will
        self.cached: dict[Hashable, int] = {}  # prompt tokens each session took from the cache
        self.input_name, self.logits_name = generative_io(executor.graph)
        self.max_batch_tokens, self.max_sessions = max_batch_tokens, max_sessions
        # One session per pass when the graph mixes rows (executor.batching() says why), or when
        # the executor is not batch-invariant (a session's tokens would depend on its company).
        self.batches = executor.rows.reason is None and executor.batch_invariant

    def stream(self, requests: Iterable[Request], *, inbox: Inbox | None = None) -> Iterator[TokenEvent]:
        """Tokens of ``requests`` as they come; ``inbox`` brings requests and cancellations that
        arrive meanwhile (taken before every pass).  Returns when no session is left."""
        sched = Scheduler(max_batch_tokens=self.max_batch_tokens, max_sessions=self.max_sessions,
                          max_kv_rows=self.max_kv_rows)
        refused: list[TokenEvent] = []

        def add(reqs: Iterable[Request]) -> None:
            for req in reqs:  # a resumed session goes on from where its KV caches are
                resume = req.resume and req.session in self.executor.sessions()
                pos = self.executor.position(req.session) if resume else self._from_cache(req)
                try:
                    sched.add(req, pos=pos, feed=req.prompt[pos:] if pos and not resume else None,
                              reset=not resume and not pos)
                except DistRuntimeError as e:  # more KV rows than the whole pool: it fails alone
                    self.executor.close_session(req.session)
                    refused.append(TokenEvent(req.session, None, 0, True, e))
                    continue
                self._fed[req.session] = [*(self._fed.get(req.session, []) if resume else []), *req.prompt]

        add(requests)
        while True:
            if inbox is not None:
                arrived, cancelled = inbox.take()
                add(arrived)
                for session in cancelled:
                    if sched.cancel(session):
                        self.close_session(session)
            yield from refused
            refused.clear()
            if sched.done:
                return
            batch = sched.next_batch(None if self.batches else 1)
            try:
                rows = self._pass(batch)
            except DistRuntimeError:  # whose rows failed? each alone: the others go on
                for work in batch:
                    try:
                        yield from sched.complete([work], self._pass([work]))
                    except DistRuntimeError as e:
                        yield sched.fail(work, e)
                continue
            for event in sched.complete(batch, rows):
                if event.token is not None and not event.done:  # fed next: its KV row will be held
                    self._fed[event.session].append(event.token)
                cached = self.cached.pop(event.session, 0) if event.index == 0 else 0
                yield replace(event, cached=cached) if cached else event

    def close_session(self, session: Hashable) -> None:
        """Forget ``session`` and free its KV caches (as the pipeline's coordinator does), or leave
        them to the prefix cache, keyed by the tokens whose rows they hold."""
        fed, rows = self._fed.pop(session, []), self.executor.position(session)
        self.cached.pop(session, None)
        if self.prefix_cache is None or len(fed) < rows:
            self.executor.close_session(session)
            return
        states = self.executor.detach_kv(session)
        if states is not None and rows:
            self.prefix_cache.add(fed[:rows], states, sum(state.nbytes()[1] for state in states.values()))

    def _from_cache(self, req: Request) -> int:
        """Start ``req``'s session from the longest cached prefix of its prompt; its rows."""
        if self.prefix_cache is None:
            return 0
        entry, rows = self.prefix_cache.lookup(req.prompt)
        if entry is not None:
            self.executor.restore_kv(req.session, entry.handle, rows)
            self.cached[req.session] = rows
        return rows

    def _pass(self, batch: Sequence[Work]) -> list[np.ndarray]:
        """One pass over the batch's rows; the last logits row of each session."""
        for work in batch:
            if work.reset:
                self.executor.reset(work.session)
            self.executor.set_kv_ceiling(work.session, work.live.kv_rows)
        tokens = np.asarray([t for w in batch for t in w.tokens], np.int32)
        segments = [Segment(w.session, len(w.tokens), w.pos) for w in batch]
        ends = np.cumsum([len(w.tokens) for w in batch]) - 1  # the logits wanted: each session's last row's
        return list(self.executor.run_batch({self.input_name: tokens}, segments, rows=ends)[self.logits_name])


@dataclass
class SessionResult:
    session: Hashable
    prompt: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token), "length", or "error"
    error: BaseException | None = None
    first_token_seconds: float | None = None  # from the start of the run
    seconds: float | None = None  # from the start of the run to the last token

    @property
    def tokens_per_second(self) -> float | None:
        """Decode rate after the first token (the first includes the prompt's prefill)."""
        if len(self.ids) < 2 or self.seconds is None or self.seconds <= self.first_token_seconds:
            return None
        return (len(self.ids) - 1) / (self.seconds - self.first_token_seconds)

    def to_json(self) -> dict:
        return {"session": self.session, "seed": self.seed, "ids": self.ids, "finish_reason": self.finish_reason,
                "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
                "first_token_seconds": self.first_token_seconds, "seconds": self.seconds,
                "tokens_per_second": self.tokens_per_second}


@dataclass
class Generation:
    """What :func:`generate` returns: per session results, in request order, and the wall time."""

    sessions: list[SessionResult]
    seconds: float

    @property
    def tokens(self) -> dict[Hashable, list[int]]:
        return {s.session: s.ids for s in self.sessions}

    @property
    def generated(self) -> int:
        return sum(len(s.ids) for s in self.sessions)

    def raise_first_error(self) -> None:
        for s in self.sessions:
            if s.error is not None:
                raise s.error


def generate(engine: Engine, requests: Sequence[Request], *,
             on_event: Callable[[TokenEvent], None] | None = None, **stream_options) -> Generation:
    """Run ``requests`` on ``engine`` to completion, timing each session; ``on_event`` sees every
    event as it arrives (for streaming output).  A session's error ends that session only."""
    results = {r.session: SessionResult(r.session, list(r.prompt), r.sampling.seed) for r in requests}
    stops = {r.session: r.stop for r in requests}
    start = time.perf_counter()
    for event in engine.stream(requests, **stream_options):
        now = time.perf_counter() - start
        res = results[event.session]
        if event.error is not None:
            res.error, res.finish_reason = event.error, "error"
        else:
            if not res.ids:
                res.first_token_seconds = now
            res.ids.append(event.token)
            res.seconds = now
            if event.done:
                res.finish_reason = "stop" if event.token in stops[event.session] else "length"
        if on_event is not None:
            on_event(event)
    return Generation(list(results.values()), time.perf_counter() - start)


def stop_ids(metadata: Mapping) -> frozenset[int]:
    """The model's end-of-sequence ids, from its metadata (``eos_token_id``: one id or a list)."""
    value = metadata.get("eos_token_id", [])
    return frozenset(value if isinstance(value, list) else [value])
