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

Recovery: when a step fails because a stage is gone (its actor or process died, its node left),
the coordinator asks ``repair`` (``Pipeline`` passes one) to replace the dead stages, rebuilds the
KV caches of every session in flight by replaying its history through the pipeline in the same
steps as the first time (so every stage computes bit for bit what it computed then), resubmits the
steps that were lost, and goes on.  Sessions not in flight are replayed when they next resume.
The tokens are those of a run without the fault; each recovery is logged and kept in
``recoveries``.  A stage that hangs gives ``StageUnavailableError`` after ``timeout`` seconds; a
stage that keeps dying, after ``max_recoveries`` attempts in a row.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import DistRuntimeError, StageUnavailableError
from ..generation import Request, TokenEvent, check_requests
from ..sampling import Sampling
from ..transport import decode_message, encode_message
from .channels import Channel
from .cluster import call_all
from .header import StepHeader
from .subgraph import StageGraph
from .telemetry import RunTelemetry

log = logging.getLogger("dist_runtime.recovery")


@dataclass
class SessionState:
    sid: Hashable
    sampling: Sampling
    rng: np.random.Generator
    history: list[int] = field(default_factory=list)  # every token fed or generated, in order
    pos: int = 0  # rows the stages' KV caches hold for this session
    generated: list[int] = field(default_factory=list)  # of the current request
    error: BaseException | None = None
    chunks: list[int] = field(default_factory=list)  # rows of each step fed, in order (sum = pos)
    stale: bool = False  # a stage lost this session's KV: replay before its next step

    def fed(self, rows: int) -> None:
        self.pos += rows
        self.chunks.append(rows)

    def rewind(self, pos: int) -> None:
        """Keep the steps that fed rows before ``pos`` (a step cut short keeps its first part)."""
        kept, total = [], 0
        for rows in self.chunks:
            if total + rows > pos:
                break
            kept.append(rows)
            total += rows
        if total < pos:
            kept.append(pos - total)
        self.chunks, self.pos = kept, pos


@dataclass(frozen=True)
class RecoveryEvent:
    """One session rebuilt after a stage was replaced."""

    session: Hashable
    stage: int  # the stage that was replaced
    position: int  # rows replayed
    seconds: float  # from the failure to the session's step being resubmitted
    cause: str


@dataclass
class _Pending:
    """A step travelling through the pipeline."""

    req: Request
    state: SessionState
    step: int
    kind: str
    tokens: list[int]
    reset: bool
    handle: object = None
    broken: StageUnavailableError | None = None  # the channel refused the step at submission


class Coordinator:
    """Sessions over a deployed pipeline (``stages`` and their ``channel``)."""

    def __init__(self, stages: list[StageGraph], actors: list, channel: Channel, *,
                 timeout: float | None = 600.0,
                 repair: Callable[[list[int]], tuple[list, Channel]] | None = None,
                 max_recoveries: int = 3, probe_timeout: float = 10.0, exact_replay: bool = True) -> None:
        self.stages, self.actors, self.channel = stages, actors, channel
        self.timeout = timeout
        self.repair, self.max_recoveries, self.probe_timeout = repair, max_recoveries, probe_timeout
        # Exact: replay in the steps first fed (bit-identical caches; one step per generated token).
        # Otherwise the whole history as one prefill: far fewer steps for long sessions, caches
        # equal within float rounding, so a later token may differ where two logits nearly tie.
        self.exact_replay = exact_replay
        self.recoveries: list[RecoveryEvent] = []
        # A graph with one token input and logits can generate; any graph can ``run``.
        first, last = stages[0], stages[-1]
        self.input_name = first.receives[0] if len(first.receives) == 1 else None
        self.logits_name = last.logits
        self.sessions: dict[Hashable, SessionState] = {}
        self._step = 0
        self.last_run: RunTelemetry | None = None

    # -- session control -----------------------------------------------------------------------
    def reset(self, session: Hashable) -> None:
        """Clear ``session`` on every stage (KV caches, position) and on the driver."""
        call_all(self.actors, "reset", session, timeout=self.timeout)
        state = self.sessions.get(session)
        if state is not None:
            state.pos, state.history, state.generated, state.chunks, state.stale = 0, [], [], [], False
            state.rng = state.sampling.rng()

    def close_session(self, session: Hashable) -> None:
        """Forget ``session`` everywhere and free its KV caches."""
        call_all(self.actors, "close_session", session, timeout=self.timeout)
        self.sessions.pop(session, None)

    def position(self, session: Hashable) -> int:
        return self.sessions[session].pos

    # -- one step, synchronously (tests, scoring) -------------------------------------------------
    def forward(self, session: Hashable, tokens: Sequence[int], *, pos: int | None = None,
                reset: bool = False, all_logits: bool = True) -> np.ndarray:
        """Run ``tokens`` for ``session`` at ``pos`` (default: the session's position) and return
        the logits (every row with ``all_logits``).  No sampling; the position advances."""
        _check_session_id(session)
        self._check_generative()
        state = self.sessions.setdefault(session, SessionState(session, Sampling(), Sampling().rng()))
        at = 0 if reset else state.pos if pos is None else pos
        if at > state.pos:
            raise DistRuntimeError(f"session {session!r} holds {state.pos} positions; cannot run at {at}")
        state.rewind(at)
        state.history = state.history[:at]
        if state.stale and at:
            self._replay([state])
        step = self._next_step()
        reply = self.channel.get(self.channel.submit(self._message(session, tokens, at, step, reset or state.stale,
                                                                   all_logits)), self.timeout)
        tensors, _ = decode_message(reply)
        state.stale = False
        state.fed(len(tokens))
        state.history += list(tokens)
        return np.array(tensors[self.logits_name])

    # -- stateless graphs (encoders, classifiers) -------------------------------------------------
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One pass of a stateless graph: its inputs in, the last stage's outputs out."""
        return self.run_many([inputs])[0]

    def run_many(self, batches: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Several passes in flight at once (stage k works on batch i while stage k+1 works on
        batch i-1); results in input order.  Each pass is its own session, closed after."""
        want = set(self.stages[0].receives)
        for i, inputs in enumerate(batches):
            if set(inputs) != want:
                raise DistRuntimeError(f"batch {i}: the graph takes {sorted(want)}, given {sorted(inputs)}")
        handles = []
        for inputs in batches:
            step = self._next_step()
            header = StepHeader(f"run:{step}", 0, step, reset=True, close=True)
            handles.append(self.channel.submit(encode_message(dict(inputs), header.to_meta())))
        return [decode_message(self.channel.get(h, self.timeout))[0] for h in handles]

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
        self._check_generative()
        waiting = deque(requests)
        check_requests(waiting)
        limit = max_in_flight or len(waiting) or 1
        run = self.last_run = RunTelemetry(len(self.stages))
        inflight: deque[_Pending] = deque()
        attempts = 0  # recoveries since the last token

        def submit(p: _Pending) -> None:
            p.step = self._next_step()
            run.submitted(p.step, p.req.session, p.kind, len(p.tokens), time.time())
            message = self._message(p.req.session, p.tokens, p.state.pos, p.step, p.reset, False)
            p.broken = None
            try:
                p.handle = self.channel.submit(message)
            except StageUnavailableError as e:  # a broken link: fails (and recovers) when its turn comes
                p.broken = e
            inflight.append(p)

        def start(req: Request) -> None:
            _check_session_id(req.session)
            state = self.sessions.get(req.session)
            if state is None or not req.resume:
                state = self.sessions[req.session] = SessionState(req.session, req.sampling, req.sampling.rng())
            state.generated, state.error = [], None
            if state.stale and state.pos:
                self._replay([state])
            # On resume, the last generated token was never fed: it goes in before the new turn.
            feed = state.history[state.pos:] + list(req.prompt)
            state.history = state.history + list(req.prompt)
            submit(_Pending(req, state, 0, "prefill", feed, not req.resume or state.stale))

        def fail(p: _Pending, error: BaseException):
            run.failed(p.step, time.time(), error)
            p.state.error = error
            return TokenEvent(p.req.session, None, len(p.state.generated), True, error)

        try:
            while waiting and len(inflight) < limit:
                start(waiting.popleft())
            while inflight:
                p = inflight.popleft()
                try:
                    if p.broken is not None:
                        raise p.broken
                    reply = self.channel.get(p.handle, self.timeout)
                    received = time.time()
                    t0 = time.perf_counter()
                    tensors, _ = decode_message(reply)
                    token = p.state.sampling.choose(tensors[self.logits_name], p.state.rng)
                    sampled = time.perf_counter() - t0
                except StageUnavailableError as e:
                    lost = [p, *inflight]
                    inflight.clear()
                    try:
                        attempts = self._recover(lost, e, attempts)
                    except Exception as final:  # noqa: BLE001 -- no way back: these sessions fail
                        for q in lost:
                            yield fail(q, final)
                        while waiting and len(inflight) < limit:
                            start(waiting.popleft())
                        continue
                    for q in lost:
                        run.steps.pop(q.step, None)  # it never finished; the resubmission is recorded
                        submit(q)
                    continue
                except Exception as e:  # noqa: BLE001 -- one session's failure ends that session only
                    yield fail(p, e)
                    if waiting:
                        start(waiting.popleft())
                    continue
                attempts = 0
                run.token(p.step, received, sampled)
                state = p.state
                state.fed(len(p.tokens))
                state.generated.append(token)
                state.history.append(token)
                done = len(state.generated) >= p.req.max_new_tokens or token in p.req.stop
                if not done:
                    submit(_Pending(p.req, state, 0, "decode", [token], False))
                elif waiting:
                    start(waiting.popleft())
                yield TokenEvent(p.req.session, token, len(state.generated) - 1, done)
        finally:
            self._collect(run)

    # -- recovery ------------------------------------------------------------------------------
    def _recover(self, lost: list[_Pending], cause: BaseException, attempts: int) -> int:
        """Replace the dead stages and replay the lost sessions' histories, retrying while stages
        keep failing; returns the attempts made since the last token.  Raises when out of tries."""
        t0 = time.perf_counter()
        while True:
            attempts += 1
            if self.repair is None or attempts > self.max_recoveries:
                raise cause
            dead = self.dead_stages()
            log.warning("pipeline step failed (%s); replacing stage(s) %s", cause, dead or "none (links only)")
            try:
                self.actors, self.channel = self.repair(dead)
                for state in self.sessions.values():
                    state.stale = state.stale or state.pos > 0
                self._replay([p.state for p in lost])
                break
            except StageUnavailableError as again:
                cause = again
        seconds = time.perf_counter() - t0
        for p in lost:
            for k in dead or [-1]:
                event = RecoveryEvent(p.req.session, k, p.state.pos, seconds, f"{type(cause).__name__}: {cause}")
                self.recoveries.append(event)
                log.warning("recovered session %r: stage %s, %d positions replayed, %.3f s",
                            event.session, event.stage, event.position, event.seconds)
        return attempts

    def dead_stages(self) -> list[int]:
        """Stages whose actor does not answer a ping within ``probe_timeout`` seconds."""
        import ray

        pings = [a.ping.remote() for a in self.actors]
        dead = []
        for k, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=self.probe_timeout)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(k)
        return dead

    def _replay(self, states: list[SessionState]) -> None:
        """Feed each session's history again, step by step as it was first fed (the first step
        resets the session everywhere), so every stage holds exactly the KV rows it held; or, with
        ``exact_replay`` off, as one prefill."""
        handles = []
        for state in states:
            at = 0
            for rows in (state.chunks if self.exact_replay else [state.pos] if state.pos else []):
                message = self._message(state.sid, state.history[at:at + rows], at, self._next_step(), at == 0, False)
                handles.append(self.channel.submit(message))
                at += rows
            state.stale = False
        for handle in handles:  # stages serve calls in order: every reply must arrive, none is used
            self.channel.get(handle, self.timeout)

    # -- internals -----------------------------------------------------------------------------
    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def warm_up(self) -> None:
        """One throwaway request end to end before the pipeline reports ready -- a prefill and a
        decode step of a scratch session through the channel, sampled on the driver, then forgotten
        on every stage -- so the first user's time to first token pays for none of it."""
        if self.input_name is None or self.logits_name is None:
            return  # a stateless graph: its stages warmed up on their own
        sid = "warmup:pipeline"
        state = SessionState(sid, Sampling(), Sampling().rng())
        token = state.sampling.choose(self.forward(sid, [0, 0], reset=True, all_logits=False), state.rng)
        self.forward(sid, [token], all_logits=False)
        self.close_session(sid)

    def _check_generative(self) -> None:
        if self.input_name is None:
            raise DistRuntimeError(f"generation needs a graph with one token input, this one takes "
                                   f"{list(self.stages[0].receives)}: use run()")
        if self.logits_name is None:
            raise DistRuntimeError("the graph has no logits output to sample from (no Sample node and no 'logits')")

    def _message(self, session, tokens, pos, step, reset, all_logits) -> bytes:
        header = StepHeader(session, int(pos), step, reset=bool(reset), all_logits=bool(all_logits))
        return encode_message({self.input_name: np.asarray(tokens, dtype=np.int32)}, header.to_meta())

    def _collect(self, run: RunTelemetry) -> None:
        """Fetch the stages' records of this run and join them with the driver's."""

        try:
            records = call_all(self.actors, "telemetry", timeout=self.timeout)
        except Exception:  # noqa: BLE001 -- telemetry must not mask the run's own outcome
            return
        for k, recs in enumerate(records):
            run.add_stage_records(k, recs)
        run.finish()



def _check_session_id(session) -> None:
    # Session ids travel in every message's metadata, which holds ints and strings only.
    if isinstance(session, bool) or not isinstance(session, (int, str)):
        raise DistRuntimeError(f"a session id is an int or a string, not {type(session).__name__}")
