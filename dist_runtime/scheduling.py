"""Continuous batching: which sessions' rows go into the next pass.

Every engine -- one process (:class:`~dist_runtime.engine.LocalEngine`) or the pipeline's
coordinator -- asks a :class:`Scheduler` for the next batch, runs it as one pass
(``GraphExecutor.run_batch``), and hands the logits back; the scheduler samples, emits the tokens
and decides the next batch.  A batch takes every ready session: one decode row per generating
session first, then chunks of waiting prompts up to ``max_batch_tokens`` rows in all, so a long
prompt is fed in chunks over several passes and never stalls the sessions that are decoding.
Sessions join as soon as they are admitted and leave when done, between passes.

Admission: at most ``max_sessions`` sessions are resident (hold KV caches) at once, and their
prompts plus new tokens together at most ``max_kv_rows`` rows; a request beyond either waits in
the queue (its place is visible in :meth:`Scheduler.queued`), it is never failed for memory.

Sampling stays per session, with the session's own seeded generator, in the order of that
session's tokens: a session's tokens do not depend on which sessions share its passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import numpy as np

from .errors import DistRuntimeError
from .scheduling_defaults import DEFAULT_BATCH_TOKENS, IDLE_PREFILL_TOKENS
from .requests import Request, TokenEvent
from .sampling import token_logprobs

@dataclass
class Live:
    """A resident session: what it still has to feed, where it is, what it generated."""

    req: Request
    rng: np.random.Generator
    feed: list[int]  # tokens to feed before the next sample (the prompt, then each new token)
    pos: int = 0  # rows fed so far: the session's position on every stage
    reset: bool = True  # its next pass clears its KV caches first (its first pass)
    generated: list[int] = field(default_factory=list)
    busy: bool = False  # a pass holding its rows is in flight
    cancelled: bool = False  # its client left while a pass held its rows: dropped when it returns

    @property
    def session(self) -> Hashable:
        return self.req.session

    @property
    def kv_rows(self) -> int:
        """The KV rows it may come to hold: what it fed, what it will feed, what it may generate."""
        return self.pos + len(self.feed) + self.req.max_new_tokens - len(self.generated)


@dataclass(frozen=True)
class Work:
    """One session's rows in a batch: ``tokens`` at ``pos``; ``samples`` when they end its feed
    (the last row's logits give its next token)."""

    live: Live
    tokens: tuple[int, ...]
    pos: int
    reset: bool
    samples: bool

    @property
    def session(self) -> Hashable:
        return self.live.session


class Scheduler:
    """Requests in, batches out, tokens out (see the module docstring)."""

    def __init__(self, requests: Iterable[Request] = (), *, max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_sessions: int | None = None, max_kv_rows: int | None = None) -> None:
        if max_batch_tokens < 1:
            raise DistRuntimeError(f"max_batch_tokens must be at least 1, got {max_batch_tokens}")
        self.max_batch_tokens = max_batch_tokens
        self.max_sessions, self.max_kv_rows = max_sessions, max_kv_rows
        self.waiting: deque[Request] = deque()
        self.live: dict[Hashable, Live] = {}  # resident sessions, in order of admission
        self._resume: dict[Hashable, tuple] = {}  # a waiting session's (pos, feed, reset, rng)
        for req in requests:
            self.add(req)

    # -- sessions in and out ---------------------------------------------------------------------
    def add(self, req: Request, *, pos: int = 0, feed: Sequence[int] | None = None, reset: bool = True,
            rng: np.random.Generator | None = None) -> None:
        """Queue ``req``; ``pos``/``feed``/``reset``/``rng`` continue a conversation (the
        coordinator's resume: the rows already held, the history still to feed, its sampler)."""
        if req.session in self.live or any(r.session == req.session for r in self.waiting):
            raise DistRuntimeError(f"session {req.session!r} already has a request in progress")
        feed = list(req.prompt) if feed is None else list(feed)
        if self.max_kv_rows is not None and pos + len(feed) + req.max_new_tokens > self.max_kv_rows:
            raise DistRuntimeError(f"session {req.session!r}: {pos + len(feed)} tokens + {req.max_new_tokens} new "
                                   f"tokens exceed the KV budget of {self.max_kv_rows} rows")
        self.waiting.append(req)
        self._resume[req.session] = (pos, feed, reset, req.sampling.rng() if rng is None else rng)

    def drop(self, session: Hashable) -> Live | None:
        """Forget ``session`` (finished, failed or cancelled); returns its state."""
        return self.live.pop(session, None)

    def cancel(self, session: Hashable) -> bool:
        """Stop ``session`` (its client left): out of the queue, or out of the batch -- at once, or
        when the pass holding its rows returns.  Returns whether it has left now."""
        for req in self.waiting:
            if req.session == session:
                self.waiting.remove(req)
                self._resume.pop(session, None)
                return True
        live = self.live.get(session)
        if live is not None and live.busy:
            live.cancelled = True
            return False
        return self.drop(session) is not None

    def queued(self) -> dict[Hashable, int]:
        """Each waiting session's place in the queue (0 = next to be admitted)."""
        return {req.session: i for i, req in enumerate(self.waiting)}

    @property
    def done(self) -> bool:
        return not self.live and not self.waiting

    # -- batches ---------------------------------------------------------------------------------
    def ready(self) -> int:
        """Sessions that could go into a pass now (admitting waiting ones first)."""
        self._admit()
        return sum(1 for s in self.live.values() if not s.busy and s.feed)

    def next_batch(self, max_sessions: int | None = None) -> list[Work]:
        """The rows of the next pass (empty when no session is ready): a decode row of every ready
        generating session, then prompt chunks, up to ``max_batch_tokens`` rows and
        ``max_sessions`` sessions.  While prompts wait, decode rows leave a quarter of the budget
        to them (new sessions always progress), and prompts fill the pass up to that quarter or
        add half the decode rows, whichever is more (a decoder's next token then waits for a
        pass of at most ~1.5 decode steps); while no
        session is generating, nobody waits between tokens, so prompts take up to
        ``IDLE_PREFILL_TOKENS``.  Its sessions are busy until :meth:`complete` or :meth:`abort`."""
        self._admit()
        ready = [s for s in self.live.values() if not s.busy and s.feed][:max_sessions]
        decode = [s for s in ready if s.generated]
        prompts = [s for s in ready if not s.generated]
        generating = any(s.generated for s in self.live.values())
        budget = self.max_batch_tokens if generating else max(self.max_batch_tokens, IDLE_PREFILL_TOKENS)
        quarter = max(1, budget // 4)  # at least a row: prompts always progress
        decode = decode[:budget - quarter] if prompts else decode[:budget]
        # Prompt rows beside decode rows lengthen the pass every decoder waits for.  The products
        # cost about the same for 1 row as for a quarter of the budget (6-8 rows: bound by reading
        # the weights), and beyond that about one decode row's compute per row (bench_batching.py,
        # F32 on this machine: 12 rows 1.44x 8 rows, 14 rows 1.88x).  So while sessions decode,
        # prompts fill a pass up to that quarter, or add half the decode rows: the decoders then
        # wait ~1.5 decode-only passes for their next token (filling the budget: 2-3).
        prompt_rows = max(quarter - len(decode), len(decode) // 2, 1) if generating else budget
        batch = []
        for s in decode + prompts:
            take = min(len(s.feed), budget if s.generated else min(budget, prompt_rows))
            if take == 0:
                break
            budget -= take
            if not s.generated:
                prompt_rows -= take
            batch.append(Work(s, tuple(s.feed[:take]), s.pos, s.reset, take == len(s.feed)))
            s.busy = True
        return batch

    def abort(self, batch: Sequence[Work]) -> None:
        """A pass that did not happen: its sessions are ready again, as they were."""
        for w in batch:
            w.live.busy = False

    def complete(self, batch: Sequence[Work], logits: Sequence[np.ndarray], chosen: bool = False) -> list[TokenEvent]:
        """The pass ran: ``logits[i]`` is the last row of ``batch[i]``'s logits (with ``chosen``,
        the token already chosen from it: greedy sessions without logprobs, whose choice the last
        stage made).  Samples the sessions whose feed ended; returns their tokens (a finished
        session leaves)."""
        events = []
        for w, row in zip(batch, logits, strict=True):
            s = w.live
            if s.cancelled:
                self.drop(s.session)
                continue
            s.busy, s.reset = False, False
            self.live[s.session] = self.live.pop(s.session)  # to the back: passes of fewer sessions than ready rotate
            s.pos += len(w.tokens)
            del s.feed[:len(w.tokens)]
            if not w.samples:
                continue
            grammar = s.req.constraint
            if grammar is not None:
                row = grammar.mask(row)
            token = int(row) if chosen else s.req.sampling.choose(row, s.rng)
            if grammar is not None:
                grammar.advance(token)
            s.generated.append(token)
            done = (len(s.generated) >= s.req.max_new_tokens or token in s.req.stop
                    or (grammar is not None and grammar.finished))
            s.feed = [] if done else [token]
            if done:
                self.drop(s.session)
            logprobs = None if s.req.logprobs is None else token_logprobs(row, token, s.req.logprobs)
            events.append(TokenEvent(s.session, token, len(s.generated) - 1, done, logprobs=logprobs))
        return events

    def fail(self, work: Work, error: BaseException) -> TokenEvent:
        """``work``'s session failed: it leaves, with an error event."""
        self.drop(work.session)
        return TokenEvent(work.session, None, len(work.live.generated), True, error)

    # -- internals -------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self._fits(self.waiting[0]):
            req = self.waiting.popleft()
            pos, feed, reset, rng = self._resume.pop(req.session)
            self.live[req.session] = Live(req, rng, feed, pos, reset)

    def _fits(self, req: Request) -> bool:
        if self.max_sessions is not None and len(self.live) >= self.max_sessions:
            return False
        if self.max_kv_rows is None:
            return True
        pos, feed, _, _ = self._resume[req.session]
        held = sum(s.kv_rows for s in self.live.values())
        return held + pos + len(feed) + req.max_new_tokens <= self.max_kv_rows
