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
``recoveries``.  When no node can take a failed stage, ``repair`` re-plans the pipeline over the
surviving nodes (:mod:`.replan`): every session in flight is replayed onto the new stages, the
newest ones ended with an error if the survivors cannot hold them all, and the re-plan is kept in
``replans``.  A stage that hangs gives ``StageUnavailableError`` after ``timeout`` seconds; a
stage that keeps dying, after ``max_recoveries`` attempts in a row.  While a recovery is under way
(from the failed step to the replacement having answered every replayed step), ``recovering()``
says so, from any thread and without a call to the stages: what a server's /health reports.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import DistRuntimeError, StageUnavailableError
from ..prefix_cache import PrefixCache
from ..requests import Inbox, Request, TokenEvent, check_requests
from ..sampling import Sampling
from ..scheduling import Scheduler, Work
from ..scheduling_defaults import DEFAULT_BATCH_TOKENS
from ..transport import decode_message, encode_message
from .channels import Channel
from .cluster import call_all
from .header import RECORDS_KEPT, BatchSegment, StepHeader
from .replan import Replan
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


@dataclass(frozen=True)
class Recovering:
    """A recovery under way (``Coordinator.recovering()``): a snapshot, never updated in place."""

    stages: tuple[int, ...]  # being replaced; empty while the failed stage is being found
    # "probing" (which stage failed?), "replacing" (new actors), "planning" (no node can take it:
    # a plan over the survivors), "loading" (the new stages' weights), "replaying" (sessions' KV)
    phase: str
    since: float  # time.monotonic() when the failed step was noticed
    attempt: int  # 1, then more if a replacement fails too
    cause: str

    def describe(self) -> dict:
        """As /health reports it."""
        which = ", ".join(map(str, self.stages))
        what = {"probing": "finding the stage that failed",
                "replacing": f"placing a new actor for stage {which}" if which else "reconnecting the stages",
                "planning": f"no node can take stage {which}: planning over the surviving nodes" if which
                else "planning the pipeline again over its nodes",
                "loading": "loading the weights of the re-planned stages",
                "replaying": f"rebuilding the sessions' caches on stage {which}" if which
                else "rebuilding the sessions' caches"}[self.phase]
        return {"stages": list(self.stages), "phase": self.phase, "attempt": self.attempt,
                "seconds": round(time.monotonic() - self.since, 3), "message": f"{what} (after {self.cause})"}


@dataclass(frozen=True)
class Repaired:
    """What ``repair`` returns: the stages' actors and channel, and when the pipeline was re-planned,
    its new stages, the KV rows the new plan holds, and the re-plan's record so far."""

    actors: list
    channel: Channel
    stages: list[StageGraph] | None = None  # None: the same stages (dead ones replaced in place)
    max_kv_rows: int | None = None
    micro_batches: int | None = None  # passes in flight that suit the new placement
    replan: Replan | None = None


@dataclass
class _Flight:
    """A batch travelling through the pipeline."""

    works: list[Work]
    step: int = 0
    handle: object = None
    broken: StageUnavailableError | None = None  # the channel refused the step at submission
    argmax: bool = False  # every session greedy: the last stage sends their tokens back


class Coordinator:
    """Sessions over a deployed pipeline (``stages`` and their ``channel``)."""

    def __init__(self, stages: list[StageGraph], actors: list, channel: Channel, *,
                 timeout: float | None = 600.0,
                 repair: Callable[[list[int], Callable[[str], None]], Repaired] | None = None,
                 max_recoveries: int = 3, probe_timeout: float = 10.0, exact_replay: bool = True,
                 micro_batches: int = 1, max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_kv_rows: int | None = None) -> None:
        self.stages, self.actors, self.channel = stages, actors, channel
        # Passes in flight at once: one per stage when the stages have machines of their own
        # (stage k computes pass i while stage k+1 computes i-1); one when they share a machine's
        # cores and memory bandwidth, where splitting the batch only re-reads the weights.
        self.micro_batches, self.max_batch_tokens = micro_batches, max_batch_tokens
        self.batching: str | None = None  # why a stage runs one session per pass (its report's), or None
        # The KV rows the plan sized every stage's memory for (sessions x context): sessions beyond
        # wait in the queue rather than push a stage past its budget.
        self.max_kv_rows = max_kv_rows
        self.timeout = timeout
        self.repair, self.max_recoveries, self.probe_timeout = repair, max_recoveries, probe_timeout
        # Exact: replay in the steps first fed (bit-identical caches; one step per generated token).
        # Otherwise the whole history as one prefill: far fewer steps for long sessions, caches
        # equal within float rounding, so a later token may differ where two logits nearly tie.
        self.exact_replay = exact_replay
        self.recoveries: list[RecoveryEvent] = []
        self.replans: list[Replan] = []
        # Re-plans asked for from other threads (a drain, a node that joined), run at a safe point:
        # between two passes of a running stream, or at once when none runs.
        self._replan_lock = threading.Lock()
        self._streaming = False
        self._pending: list[tuple[Callable[[Callable[[str], None]], Repaired], Future]] = []
        # Written by the engine thread only, read by any (a server's /health): each write binds a
        # new frozen snapshot, and binding an attribute is atomic, so readers need no lock.
        self._recovering: Recovering | None = None
        # A graph with one token input and logits can generate; any graph can ``run``.
        first, last = stages[0], stages[-1]
        self.input_name = first.receives[0] if len(first.receives) == 1 else None
        self.logits_name = last.logits
        self.sessions: dict[Hashable, SessionState] = {}
        self._step = 0
        self.last_run: RunTelemetry | None = None
        # A prefix cache (set_prefix_cache): the index here, the entries' KV states on the stages.
        self.prefix_cache: PrefixCache | None = None
        self._handles = itertools.count(1)
        self._cached: dict[Hashable, int] = {}  # prompt tokens each new session took from the cache

    def set_prefix_cache(self, budget: int) -> None:
        """Keep ended sessions' KV rows on the stages, up to ``budget`` bytes a stage, for new
        requests that begin with the same tokens (:mod:`dist_runtime.prefix_cache`; 0: none)."""
        self.prefix_cache = PrefixCache(budget, evict=self._drop_parked) if budget else None

    def _drop_parked(self, handle: int) -> None:
        for ref in [a.drop_parked.remote(handle) for a in self.actors]:
            self._get_or_lost(ref)

    def _get_or_lost(self, ref):
        """``ray.get(ref)``, or None when its stage died or cannot be reached."""
        import ray

        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.RayActorError:
            return None

    # -- session control -----------------------------------------------------------------------
    def reset(self, session: Hashable) -> None:
        """Clear ``session`` on every stage (KV caches, position) and on the driver."""
        call_all(self.actors, "reset", session, timeout=self.timeout)
        state = self.sessions.get(session)
        if state is not None:
            state.pos, state.history, state.generated, state.chunks, state.stale = 0, [], [], [], False
            state.rng = state.sampling.rng()

    def close_session(self, session: Hashable) -> None:
        """Forget ``session`` everywhere and free its KV caches.  A stage that died holds none (its
        replacement starts empty): it is passed over here, and recovered at the next step."""
        state = self.sessions.pop(session, None)
        self._cached.pop(session, None)
        if self.prefix_cache is not None and state is not None and state.pos and not state.stale:
            handle = next(self._handles)
            sizes = [self._get_or_lost(a.park.remote(session, handle)) for a in self.actors]
            if all(sizes) and self.prefix_cache.add(state.history[:state.pos], handle, max(sizes)):
                return
            self._drop_parked(handle)  # the cache took nothing: no whole block, a stage lost it, or over budget
        for ref in [a.close_session.remote(session) for a in self.actors]:
            self._get_or_lost(ref)  # a dead stage holds nothing left to free

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
                                                                   "all" if all_logits else "last")), self.timeout)
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

    def stream(self, requests: Iterable[Request], *, max_in_flight: int | None = None,
               max_batch_tokens: int | None = None, micro_batches: int | None = None,
               inbox: Inbox | None = None, telemetry_steps: int | None = None) -> Iterator[TokenEvent]:
        """Tokens as they are produced (see the module docstring).  ``max_in_flight`` bounds the
        resident sessions (more wait in the queue), ``max_batch_tokens`` the rows of one pass,
        ``micro_batches`` the passes travelling at once (default: :attr:`micro_batches`);
        ``inbox`` brings requests and cancellations that arrive meanwhile (taken whenever passes
        are submitted; a cancelled session's KV caches are freed on every stage);
        ``telemetry_steps`` bounds the step records :attr:`last_run` keeps (default: RECORDS_KEPT)."""
        self._check_generative()
        requests = list(requests)
        check_requests(requests)
        sched = Scheduler(max_batch_tokens=max_batch_tokens or self.max_batch_tokens, max_sessions=max_in_flight,
                          max_kv_rows=self.max_kv_rows)
        for req in requests:
            self._admit(sched, req)
        slots = micro_batches or self.micro_batches
        run = self.last_run = RunTelemetry(len(self.stages), micro_batches=slots,
                                            max_steps=telemetry_steps or RECORDS_KEPT)
        run_started = time.time()
        inflight: deque[_Flight] = deque()
        attempts = 0  # recoveries since the last token
        gone: list = []  # cancelled sessions whose caches are still to be freed

        def submit(flight: _Flight) -> None:
            works = flight.works
            stale = [self.sessions[w.session] for w in works if w.pos and self.sessions[w.session].stale]
            if stale:  # replaced stages lost these sessions' caches while they waited for a slot
                self._replay(stale)
            flight.step = self._next_step()
            kind = "decode" if all(len(w.tokens) == 1 and w.pos for w in works) else "prefill"
            run.submitted(flight.step, [w.session for w in works], kind, sum(len(w.tokens) for w in works),
                          time.time(), queued=len(sched.waiting), slot=len(inflight))
            flight.broken = None
            try:
                flight.argmax = all(w.live.req.sampling.greedy and w.live.req.logprobs is None
                                    and w.live.req.constraint is None for w in works)
                flight.handle = self.channel.submit(self._batch_message(works, flight.step, "argmax" if flight.argmax else "last"))
            except StageUnavailableError as e:  # a broken link: fails (and recovers) when its turn comes
                flight.broken = e
            inflight.append(flight)

        def fill() -> None:
            """Split the ready sessions over the free micro-batch slots."""
            if inbox is not None:
                arrived, cancelled = inbox.take()
                for req in arrived:
                    check_requests([req])
                    self._admit(sched, req)
                for session in cancelled:
                    gone.append(session)
                    sched.cancel(session)
            for session in [s for s in gone if s not in sched.live]:  # left the batch: free its caches
                gone.remove(session)
                self.close_session(session)
            if self._pending and not inflight:  # a safe point: no pass travels
                self._run_pending()
                sched.max_kv_rows = self.max_kv_rows
            while len(inflight) < slots and not self._pending:
                ready = sched.ready()
                if not ready:
                    return
                share = 1 if self.batching else -(-ready // (slots - len(inflight)))
                submit(_Flight(sched.next_batch(share)))

        def fail(work: Work, error: BaseException) -> TokenEvent:
            self.sessions[work.session].error = error
            return sched.fail(work, error)

        with self._replan_lock:
            self._streaming = True
        try:
            fill()
            while inflight:
                flight = inflight.popleft()
                try:
                    if flight.broken is not None:
                        raise flight.broken
                    reply = self.channel.get(flight.handle, self.timeout)
                    received = time.time()
                    t0 = time.perf_counter()
                    logits = decode_message(reply)[0][self.logits_name]
                    events = sched.complete(flight.works, list(logits[-len(flight.works):]), chosen=flight.argmax)
                    sampled = time.perf_counter() - t0
                except StageUnavailableError as e:
                    lost = [flight, *inflight]
                    inflight.clear()
                    try:
                        attempts, replan = self._recover([self.sessions[w.session] for f in lost for w in f.works],
                                                         e, attempts)
                    except Exception as final:  # noqa: BLE001 -- no way back: these sessions fail
                        for f in lost:
                            run.failed(f.step, time.time(), final)
                            for w in f.works:
                                yield fail(w, final)
                        fill()
                        continue
                    if replan is not None:
                        run.replanned(replan)
                        sched.max_kv_rows = self.max_kv_rows
                    for f in lost:
                        run.steps.pop(f.step, None)  # it never finished; the resubmission is recorded
                        shed = replan.shed if replan is not None else ()
                        kept = [w for w in f.works if w.session not in shed]
                        for w in f.works:
                            if w.session in shed:
                                yield fail(w, self.sessions[w.session].error)
                        if kept:
                            submit(_Flight(kept))
                    continue
                except Exception as e:  # noqa: BLE001 -- one session's failure ends that session only
                    run.failed(flight.step, time.time(), e)
                    if len(flight.works) == 1:
                        yield fail(flight.works[0], e)
                    else:  # whose rows failed? each alone: the others go on
                        for w in flight.works:
                            submit(_Flight([w]))
                    fill()
                    continue
                attempts = 0
                run.token(flight.step, received, sampled, [e.session for e in events])
                for w in flight.works:
                    state = self.sessions[w.session]
                    state.stale = False
                    state.fed(len(w.tokens))
                for event in events:
                    state = self.sessions[event.session]
                    state.generated.append(event.token)
                    state.history.append(event.token)
                fill()  # the next passes travel while the caller handles these tokens
                for event in events:
                    cached = self._cached.pop(event.session, 0) if event.index == 0 else 0
                    yield replace(event, cached=cached) if cached else event
        finally:
            with self._replan_lock:
                self._streaming = False
                self._run_pending()  # asked for after the last safe point
            run.replans.extend(r for r in self.replans if r.at >= run_started and r not in run.replans)
            self._collect(run)

    def _admit(self, sched: Scheduler, req: Request) -> None:
        """Queue ``req`` with its session's place in the conversation."""
        _check_session_id(req.session)
        state = self.sessions.get(req.session)
        if state is None or not req.resume:
            state = self.sessions[req.session] = SessionState(req.session, req.sampling, req.sampling.rng())
        state.generated, state.error = [], None
        if not req.resume and self._from_cache(sched, req, state):
            return
        reset = not req.resume or state.stale
        if reset and req.resume and state.pos:  # a stage lost it: rebuild its caches first
            self._replay([state])
            reset = False
        # On resume, the last generated token was never fed: it goes in before the new turn.
        feed = state.history[state.pos:] + list(req.prompt)
        state.history = state.history + list(req.prompt)
        sched.add(req, pos=state.pos, feed=feed, reset=reset, rng=state.rng)

    def _from_cache(self, sched: Scheduler, req: Request, state: SessionState) -> bool:
        """Start ``req``'s new session from the longest cached prefix of its prompt, the stages
        copying the entry's rows; whether one was found."""
        if self.prefix_cache is None:
            return False
        entry, rows = self.prefix_cache.lookup(req.prompt)
        if entry is None:
            return False
        call_all(self.actors, "restore_parked", req.session, entry.handle, rows, timeout=self.timeout)
        state.history, self._cached[req.session] = list(req.prompt), rows
        state.fed(rows)
        sched.add(req, pos=rows, feed=list(req.prompt[rows:]), reset=False, rng=state.rng)
        return True

    # -- recovery ------------------------------------------------------------------------------
    def _recover(self, lost: list[SessionState], cause: BaseException, attempts: int) -> tuple[int, Replan | None]:
        """Replace the dead stages (or re-plan without them) and replay the lost sessions'
        histories, retrying while stages keep failing; returns the attempts made since the last
        token and the re-plan, if there was one.  Raises when out of tries."""
        t0 = time.perf_counter()
        since = time.monotonic()
        stages: list[int] = []

        def phase(name: str) -> None:
            # Ray's errors run to many lines (a traceback): /health gets the first, bounded.
            text = (str(cause).splitlines() or [""])[0][:200]
            self._recovering = Recovering(tuple(stages), name, since, attempts, f"{type(cause).__name__}: {text}")

        replan = None
        try:
            while True:
                attempts += 1
                if self.repair is None or attempts > self.max_recoveries:
                    raise cause
                phase("probing")
                stages = dead = self.dead_stages()
                log.warning("pipeline step failed (%s); replacing stage(s) %s", cause, dead or "none (links only)")
                try:
                    phase("replacing")
                    repaired = self.repair(dead, phase)
                    self.actors, self.channel = repaired.actors, repaired.channel
                    if self.prefix_cache is not None:  # the replaced stages kept no entry
                        self.prefix_cache.clear()
                    for state in self.sessions.values():
                        state.stale = state.stale or state.pos > 0
                    if repaired.replan is not None:
                        replan = self._replanned(repaired, lost, detect=time.perf_counter() - t0
                                                 - sum(repaired.replan.seconds.values()))
                        lost = [s for s in lost if s.sid not in replan.shed]
                    phase("replaying")
                    replayed = time.perf_counter()
                    self._replay(lost)
                    break
                except StageUnavailableError as again:
                    cause = again
        finally:
            self._recovering = None  # recovered, or given up (a dead stage then shows as down)
        seconds = time.perf_counter() - t0
        if replan is not None:
            replan = replace(replan, seconds={**replan.seconds, "replay": time.perf_counter() - replayed})
            self.replans[-1] = replan
            log.warning("%s", replan.line())
        for state in lost:
            for k in dead or [-1]:
                event = RecoveryEvent(state.sid, k, state.pos, seconds, f"{type(cause).__name__}: {cause}")
                self.recoveries.append(event)
                log.warning("recovered session %r: stage %s, %d positions replayed, %.3f s",
                            event.session, event.stage, event.position, event.seconds)
        return attempts, replan

    def _replanned(self, repaired: Repaired, lost: list[SessionState], detect: float) -> Replan:
        """Take the new stages of a re-plan; the newest of the ``lost`` sessions beyond what the
        new plan holds are shed (ended with an error).  Returns the record, kept in ``replans``."""
        self.stages, self.max_kv_rows = repaired.stages, repaired.max_kv_rows
        self.micro_batches = repaired.micro_batches or self.micro_batches  # the next stream's
        replan = repaired.replan
        order = {sid: i for i, sid in enumerate(self.sessions)}  # admission order
        newest = sorted({s.sid for s in lost}, key=order.get, reverse=True)
        shed = tuple(newest[:max(0, len(newest) - replan.sessions)]) if replan.sessions is not None else ()
        error = StageUnavailableError(
            f"session ended: the pipeline was re-planned over {len(replan.new)} surviving node(s), which "
            f"hold the KV caches of {replan.sessions} session(s); the newest sessions were shed")
        for sid in shed:
            self.sessions[sid].error = error
        replan = replace(replan, shed=shed, seconds={"detect": max(detect, 0.0), **replan.seconds})
        self.replans.append(replan)
        return replan

    def replan(self, make: Callable[[Callable[[str], None]], Repaired]) -> Replan:
        """Re-plan the pipeline at a safe point: ``make(progress)`` deploys the new stages (see
        ``Pipeline.drain``).  While a stream runs (in another thread), its passes in flight come
        back first and no new one leaves until it is done; else it runs now.  Every session is
        replayed onto the new stages before its next step.  Returns the record."""
        done: Future = Future()
        with self._replan_lock:
            self._pending.append((make, done))
            if not self._streaming:
                self._run_pending()
        return done.result()

    def _run_pending(self) -> None:
        """Run the re-plans asked for (the engine thread, or the caller's when no stream runs)."""
        while self._pending:
            make, done = self._pending.pop(0)
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(self._replan_now(make))
                except BaseException as e:  # noqa: BLE001 -- the asker hears it; the stream goes on
                    done.set_exception(e)

    def _replan_now(self, make: Callable[[Callable[[str], None]], Repaired]) -> Replan:
        since = time.monotonic()

        def phase(name: str) -> None:
            self._recovering = Recovering((), name, since, 1, "a re-plan")

        try:
            repaired = make(phase)
        finally:
            self._recovering = None
        self.actors, self.channel = repaired.actors, repaired.channel
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        for state in self.sessions.values():
            state.stale = state.stale or state.pos > 0  # replayed before its next step
        replan = self._replanned(repaired, [], detect=0.0)
        phase("replaying")
        t0 = time.perf_counter()
        try:
            self._replay([state for state in self.sessions.values() if state.stale and state.pos])
        finally:
            self._recovering = None
        replan = self.replans[-1] = replace(replan, seconds={**replan.seconds, "replay": time.perf_counter() - t0})
        log.warning("%s", replan.line())
        return replan

    def recovering(self) -> Recovering | None:
        """The recovery under way, or None: cheap (no call to the stages) and safe from any thread."""
        return self._recovering

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
                message = self._message(state.sid, state.history[at:at + rows], at, self._next_step(), at == 0, "last")
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

    def _batch_message(self, works: list[Work], step: int, logits: str) -> bytes:
        """A pass over ``works``; ``logits``: what the last stage sends back (``StepHeader.logits``)."""
        if len(works) == 1:
            w = works[0]
            return self._message(w.session, w.tokens, w.pos, step, w.reset, logits, w.live.kv_rows)
        header = StepHeader(works[0].session, works[0].pos, step, logits=logits,
                            batch=tuple(BatchSegment(w.session, w.pos, len(w.tokens), w.reset, w.live.kv_rows)
                                        for w in works))
        tokens = np.asarray([t for w in works for t in w.tokens], dtype=np.int32)
        return encode_message({self.input_name: tokens}, header.to_meta())

    def _message(self, session, tokens, pos, step, reset, logits: str, ceiling: int = 0) -> bytes:
        header = StepHeader(session, int(pos), step, reset=bool(reset), logits=logits, ceiling=ceiling)
        return encode_message({self.input_name: np.asarray(tokens, dtype=np.int32)}, header.to_meta())

    def _collect(self, run: RunTelemetry) -> None:
        """Fetch the stages' records of this run and join them with the driver's."""

        try:
            records = call_all(self.actors, "telemetry", min(run.steps, default=0), timeout=self.timeout)
        except Exception:  # noqa: BLE001 -- telemetry must not mask the run's own outcome
            return
        for k, recs in enumerate(records):
            run.add_stage_records(k, recs)
        run.finish()



def _check_session_id(session) -> None:
    # Session ids travel in every message's metadata, which holds ints and strings only.
    if isinstance(session, bool) or not isinstance(session, (int, str)):
        raise DistRuntimeError(f"a session id is an int or a string, not {type(session).__name__}")
