"""What an engine is asked for and what it answers, token by token (a leaf: the scheduler and the
engines both build on it)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from .errors import DistRuntimeError
from .sampling import Sampling, TokenLogprobs


@dataclass
class Request:
    """Generate up to ``max_new_tokens`` for ``session`` after ``prompt``.

    ``stop`` holds token ids that end the generation (the model's end-of-sequence); the stop token
    is part of the output.  ``resume=True`` continues the session's conversation from its position
    (the prompt is the new turn); otherwise the session starts afresh at position 0.  ``logprobs``
    asks every token event for the token's log-probability and the ``logprobs`` most likely
    alternatives (:func:`~dist_runtime.sampling.token_logprobs`).  ``constraint`` (a
    :class:`~dist_runtime.grammar.Constraint`) restricts each token to what its grammar allows;
    the session ends when the grammar is complete.
    """

    session: Hashable
    prompt: Sequence[int]
    max_new_tokens: int = 16
    sampling: Sampling = field(default_factory=Sampling)
    stop: frozenset[int] = frozenset()
    resume: bool = False
    logprobs: int | None = None
    constraint: Any = None


@dataclass(frozen=True)
class TokenEvent:
    session: Hashable
    token: int | None  # None when the session failed (see ``error``)
    index: int  # 0 for the first generated token
    done: bool
    error: BaseException | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    cached: int = 0  # on a session's first event: prompt tokens its KV rows came from the prefix cache for


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


class Inbox:
    """Requests and cancellations that arrive while an engine streams (a server's door; thread
    safe).  The engine takes what is there before every pass: new requests join the running batch,
    a cancelled session leaves it and its KV caches are freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._cancelled: list[Hashable] = []

    def put(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)

    def cancel(self, session: Hashable) -> None:
        with self._lock:
            self._cancelled.append(session)

    def take(self) -> tuple[list[Request], list[Hashable]]:
        """What arrived since the last call: (requests, cancelled sessions)."""
        with self._lock:
            out = self._requests, self._cancelled
            self._requests, self._cancelled = [], []
        return out

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._requests or self._cancelled)
