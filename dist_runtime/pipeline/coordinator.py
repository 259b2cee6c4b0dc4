"""The coordinator: sessions, positions, sampling, and many sessions' steps in flight.

A session is an id with a position, its token history and its sampling settings (with its own
seeded generator).  The coordinator injects the position into every step's message (each stage
passes it to its executor as ``pos``), marks a session's first step to reset that session's KV
caches on every stage, runs the prompt as one prefill step, then one decode step per token.

Pipelining: up to ``max_in_flight`` sessions each have one step travelling through the stages at a
time.  Stages serve calls in arrival order, so while stage 1 computes session B's step, stage 2
computes session A's: with as many sessions in flight as stages, every stage has work.  The driver
takes replies oldest first (the order the last stage produces them), samples the next token, and
submits that session's next step before handing the token to the caller, so the pipeline never
waits on the consumer.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import DistRuntimeError
from ..transport import decode_message, encode_message
from .channels import Channel
from .sampling import Sampling
from .subgraph import StageGraph
from .telemetry import RunTelemetry


@dataclass
class Request:
    """Generate up to ``max_new_tokens`` for ``session`` after ``prompt``.

    ``resume=True`` continues the session's conversation from its position (the prompt is the
    new turn); otherwise the session starts afresh at position 0.
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


@dataclass
class SessionState:
    sid: Hashable
    sampling: Sampling
    rng: np.random.Generator
    history: list[int] = field(default_factory=list)  # every token fed or generated, in order
    pos: int = 0  # rows the stages' KV caches hold for this session
    generated: list[int] = field(default_factory=list)  # of the current request
    error: BaseException | None = None


class Coordinator:
    """Sessions over a deployed pipeline (``stages`` and their ``channel``)."""

    def __init__(self, stages: list[StageGraph], actors: list, channel: Channel, *,
                 timeout: float | None = 600.0) -> None:
        self.stages, self.actors, self.channel = stages, actors, channel
        self.timeout = timeout
        first, last = stages[0], stages[-1]
        if len(first.receives) != 1:
            raise DistRuntimeError(f"generation needs a graph with one token input, this one takes {list(first.receives)}")
        self.input_name = first.receives[0]
        if last.logits is None:
            raise DistRuntimeError("the graph has no logits output to sample from (no Sample node and no 'logits')")
        self.logits_name = last.logits
        self.sessions: dict[Hashable, SessionState] = {}
        self._step = 0
        self.last_run: RunTelemetry | None = None

    # -- session control -----------------------------------------------------------------------
    def reset(self, session: Hashable) -> None:
        """Clear ``session`` on every stage (KV caches, position) and on the driver."""
        import ray

        ray.get([a.reset.remote(session) for a in self.actors], timeout=self.timeout)
        state = self.sessions.get(session)
        if state is not None:
            state.pos, state.history, state.generated = 0, [], []
            state.rng = state.sampling.rng()

    def close_session(self, session: Hashable) -> None:
        """Forget ``session`` everywhere and free its KV caches."""
        import ray

        ray.get([a.close_session.remote(session) for a in self.actors], timeout=self.timeout)
        self.sessions.pop(session, None)

    def position(self, session: Hashable) -> int:
        return self.sessions[session].pos

    # -- one step, synchronously (tests, scoring) -------------------------------------------------
    def forward(self, session: Hashable, tokens: Sequence[int], *, pos: int | None = None,
                reset: bool = False, all_logits: bool = True) -> np.ndarray:
        """Run ``tokens`` for ``session`` at ``pos`` (default: the session's position) and return
        the logits (every row with ``all_logits``).  No sampling; the position advances."""
        _check_session_id(session)
        state = self.sessions.setdefault(session, SessionState(session, Sampling(), Sampling().rng()))
        if reset:
            state.pos, state.history = 0, []
        at = state.pos if pos is None else pos
        step = self._next_step()
        reply = self.channel.get(self.channel.submit(self._message(session, tokens, at, step, reset, all_logits)),
                                 self.timeout)
        tensors, _ = decode_message(reply)
        state.pos = at + len(tokens)
        state.history = state.history[:at] + list(tokens)
        return np.array(tensors[self.logits_name])

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request], *, max_in_flight: int | None = None,
                 on_token: Callable[[TokenEvent], None] | None = None) -> dict[Hashable, list[int]]:
        """Run every request to completion; returns the generated tokens per session.

        Raises the first session's error after the others have finished.
        """
        out: dict[Hashable, list[int]] = {}
        errors = []
        for event in self.stream(requests, max_in_flight=max_in_flight):
            if on_token is not None:
                on_token(event)
            if event.error is not None:
                errors.append(event.error)
            else:
                out.setdefault(event.session, []).append(event.token)
        if errors:
            raise errors[0]
        return out

    def stream(self, requests: Iterable[Request], *, max_in_flight: int | None = None) -> Iterator[TokenEvent]:
        """Tokens as they are produced, interleaved across sessions (see the module docstring)."""
        waiting = deque(requests)
        ids = [r.session for r in waiting]
        if len(set(ids)) != len(ids):
            raise DistRuntimeError("one request per session at a time")
        limit = max_in_flight or len(waiting) or 1
        run = self.last_run = RunTelemetry(len(self.stages))
        inflight: deque = deque()  # (request, state, step id, channel handle, rows fed)

        def submit(req: Request, state: SessionState, tokens: Sequence[int], reset: bool, kind: str) -> None:
            step = self._next_step()
            run.submitted(step, req.session, kind, len(tokens), time.time())
            message = self._message(req.session, tokens, state.pos, step, reset, False)
            inflight.append((req, state, step, self.channel.submit(message), len(tokens)))

        def start(req: Request) -> None:
            _check_session_id(req.session)
            state = self.sessions.get(req.session)
            if state is None or not req.resume:
                state = self.sessions[req.session] = SessionState(req.session, req.sampling, req.sampling.rng())
            state.generated, state.error = [], None
            if not req.prompt:
                raise DistRuntimeError(f"session {req.session!r}: an empty prompt")
            if req.max_new_tokens < 1:
                raise DistRuntimeError(f"session {req.session!r}: max_new_tokens must be at least 1")
            # On resume, the last generated token was never fed: it goes in before the new turn.
            feed = state.history[state.pos:] + list(req.prompt)
            state.history = state.history + list(req.prompt)
            submit(req, state, feed, not req.resume, "prefill")

        try:
            while waiting and len(inflight) < limit:
                start(waiting.popleft())
            while inflight:
                req, state, step, handle, rows = inflight.popleft()
                try:
                    reply = self.channel.get(handle, self.timeout)
                    received = time.time()
                    t0 = time.perf_counter()
                    tensors, _ = decode_message(reply)
                    token = state.sampling.choose(tensors[self.logits_name], state.rng)
                    sampled = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 -- one session's failure ends that session only
                    run.failed(step, time.time(), e)
                    state.error = e
                    yield TokenEvent(req.session, None, len(state.generated), True, e)
                    if waiting:
                        start(waiting.popleft())
                    continue
                run.token(step, received, sampled)
                state.pos += rows
                state.generated.append(token)
                state.history.append(token)
                done = len(state.generated) >= req.max_new_tokens or token in req.stop
                if not done:
                    submit(req, state, [token], False, "decode")
                elif waiting:
                    start(waiting.popleft())
                yield TokenEvent(req.session, token, len(state.generated) - 1, done)
        finally:
            self._collect(run)

    # -- internals -----------------------------------------------------------------------------
    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _message(self, session, tokens, pos, step, reset, all_logits) -> bytes:
        meta = {"session": session, "pos": int(pos), "step": step}
        if reset:
            meta["reset"] = True
        if all_logits:
            meta["logits"] = "all"
        return encode_message({self.input_name: np.asarray(tokens, dtype=np.int32)}, meta)

    def _collect(self, run: RunTelemetry) -> None:
        """Fetch the stages' records of this run and join them with the driver's."""
        import ray

        try:
            records = ray.get([a.telemetry.remote() for a in self.actors], timeout=self.timeout)
        except Exception:  # noqa: BLE001 -- telemetry must not mask the run's own outcome
            return
        for k, recs in enumerate(records):
            run.add_stage_records(k, recs)
        run.finish()



def _check_session_id(session) -> None:
    # Session ids travel in every message's metadata, which holds ints and strings only.
    if isinstance(session, bool) or not isinstance(session, (int, str)):
        raise DistRuntimeError(f"a session id is an int or a string, not {type(session).__name__}")
