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
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from .errors import DistRuntimeError
from .sampling import Sampling


@dataclass
class Request:
    """Generate up to ``max_new_tokens`` for ``session`` after ``prompt``.

    ``stop`` holds token ids that end the generation (the model's end-of-sequence); the stop token
    is part of the output.  ``resume=True`` continues the session's conversation from its position
    (the prompt is the new turn); otherwise the session starts afresh at position 0.
    """

    session: Hashable
    prompt: Sequence[int]
    max_new_tokens: int = 16
    sampling: Sampling = field(default_factory=Sampling)
    stop: frozenset[int] = frozenset()
    resume: bool = False


@dataclass(frozen=True)
class TokenEvent:
    session: Hashable
    token: int | None  # None when the session failed (see ``error``)
    index: int  # 0 for the first generated token
    done: bool
    error: BaseException | None = None


class Engine(Protocol):
    def stream(self, requests: Iterable[Request]) -> Iterator[TokenEvent]: ...


def check_requests(requests: Sequence[Request], *, vocab: int | None = None, context: int | None = None) -> None:
    """Refuse, before any work, what no engine could serve: duplicate sessions, empty prompts,
    ids outside the vocabulary, a prompt plus ``max_new_tokens`` longer than the context."""
    ids = [r.session for r in requests]
    if len(set(ids)) != len(ids):
        raise DistRuntimeError("one request per session at a time")
    for r in requests:
        where = f"session {r.session!r}"
        if not r.prompt:
            raise DistRuntimeError(f"{where}: the prompt is empty: generation needs at least one token")
        if r.max_new_tokens < 1:
            raise DistRuntimeError(f"{where}: max_new_tokens must be at least 1, got {r.max_new_tokens}")
        if vocab and not all(0 <= t < vocab for t in r.prompt):
            bad = next(t for t in r.prompt if not 0 <= t < vocab)
            raise DistRuntimeError(f"{where}: prompt id {bad} is outside the vocabulary [0, {vocab})")
        if context and not r.resume and len(r.prompt) + r.max_new_tokens > context:
            raise DistRuntimeError(f"{where}: {len(r.prompt)} prompt tokens + {r.max_new_tokens} new tokens "
                                   f"exceed the context length {context}")


def generative_io(graph) -> tuple[str, str]:
    """(token input, logits output) of a graph that can generate; a ``DistRuntimeError`` saying
    what to do instead for one that cannot (an encoder)."""
    from .pipeline.subgraph import driver_outputs

    _, logits = driver_outputs(graph)
    names = graph.input_names
    if logits is None or len(names) != 1:
        raise DistRuntimeError(f"this graph cannot generate: it needs one token input and a 'logits' output "
                               f"(inputs {names}, outputs {graph.outputs}); for sentence embeddings use "
                               f"`dist-runtime embed`")
    return names[0], logits


class LocalEngine:
    """Requests on one ``GraphExecutor`` in this process, sessions interleaved step by step (round
    robin, as the pipeline interleaves them) so that a leak between sessions would show."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.input_name, self.logits_name = generative_io(executor.graph)

    def _step(self, session: Hashable, tokens: Sequence[int]) -> np.ndarray:
        return self.executor.run({self.input_name: np.asarray(tokens, np.int32)}, session=session)[self.logits_name]

    def stream(self, requests: Iterable[Request]) -> Iterator[TokenEvent]:
        live: deque[tuple[Request, np.random.Generator, list[int], list[int]]] = deque()
        for req in requests:
            if not req.resume:
                self.executor.reset(req.session)
            live.append((req, req.sampling.rng(), list(req.prompt), []))
        while live:
            req, rng, feed, out = item = live.popleft()
            try:
                token = req.sampling.choose(self._step(req.session, feed), rng)
            except DistRuntimeError as e:
                yield TokenEvent(req.session, None, len(out), True, e)
                continue
            out.append(token)
            done = len(out) >= req.max_new_tokens or token in req.stop
            yield TokenEvent(req.session, token, len(out) - 1, done)
            if not done:
                feed[:] = [token]
                live.append(item)


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
