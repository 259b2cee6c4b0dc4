"""Between the asyncio server and the engines, which block: one thread owns the engine.

The engines (``LocalEngine``, the pipeline's coordinator) batch continuously: ``stream([],
inbox=...)`` takes requests and cancellations from an :class:`~dist_runtime.requests.Inbox`
before every pass and returns when no session is left.  The engine thread waits until the inbox
has something, streams until it is empty again, and hands each token to the asyncio queue of the
request that owns the session (``call_soon_threadsafe``); a finished session is closed at once
(its KV caches freed: a server sees an unbounded number of sessions).  Each session's moments --
arrival, taken by the engine, every token, its end -- go to the metrics' latency histograms.
Encoders run one call at a time on a thread of their own.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Sequence

from ..errors import DistRuntimeError
from ..requests import Inbox, Request, TokenEvent
from .metrics import Metrics


class QueueFull(DistRuntimeError):
    """More sessions than ``max_queue`` would be outstanding (the client should retry)."""


class ShuttingDown(DistRuntimeError):
    """The server stops: requests still running end with this error."""


class Subscription:
    """The events of one HTTP request's sessions, as they come; ``None`` when ``keep_alive``
    seconds passed without one.  Sessions it leaves unfinished are cancelled when it closes."""

    def __init__(self, bridge: EngineBridge, sessions: Sequence[Hashable], keep_alive: float | None) -> None:
        self.bridge, self.keep_alive = bridge, keep_alive
        self.open = set(sessions)
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | None:
        if not self.open:
            raise StopAsyncIteration
        try:
            event = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            try:  # a timer, not wait_for's task per token
                async with asyncio.timeout(self.keep_alive):
                    event = await self.queue.get()
            except TimeoutError:
                return None
        if event.done:
            self.open.discard(event.session)
        return event

    def finish(self, session: Hashable) -> None:
        """The caller is done with ``session`` before the engine is (a stop string matched)."""
        if session in self.open:
            self.open.discard(session)
            self.bridge.cancel(session)

    def close(self) -> None:
        for session in list(self.open):
            self.finish(session)


class EngineBridge:
    """One engine thread for many asyncio requests (see the module docstring)."""

    def __init__(self, engine, metrics: Metrics, *, max_queue: int = 64, stream_options: dict | None = None) -> None:
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.stream_options = stream_options or {}
        self.inbox = _TimedInbox(metrics)
        self._lock = threading.Lock()
        self._routes: dict[Hashable, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Events on their way to each event loop: one wake-up of a loop carries every event of a
        # pass routed before it ran (not a call_soon_threadsafe, a self-pipe write, per token).
        self._pending: dict[asyncio.AbstractEventLoop, list] = {}
        self._waiting: set[Hashable] = set()  # no token yet: queued or in prefill
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        self._thread = threading.Thread(target=self._run, name="dist-runtime engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def subscribe(self, requests: Sequence[Request], keep_alive: float | None = None) -> Subscription:
        """Send ``requests`` to the engine; their events arrive on the subscription.  Raises
        :class:`QueueFull` when they would take more than ``max_queue`` sessions outstanding."""
        sub = Subscription(self, [r.session for r in requests], keep_alive)
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._routes) + len(requests) > self.max_queue:
                raise QueueFull(f"{len(self._routes)} sessions are running or queued (--max-queue "
                                f"{self.max_queue}); retry later")
            for r in requests:
                self._routes[r.session] = (loop, sub.queue)
                self._waiting.add(r.session)
                self.metrics.arrived(r.session, len(r.prompt))  # before the engine can take it
                self.inbox.put(r)
            self._update_gauges()
        self._wake.set()
        return sub

    def cancel(self, session: Hashable) -> None:
        """The client is gone: the session leaves the batch and its KV caches are freed."""
        with self._lock:
            if self._routes.pop(session, None) is None:
                return
            self._waiting.discard(session)
            self._update_gauges()
            self.inbox.cancel(session)
        self.metrics.ended(session)
        self._wake.set()

    def stop(self) -> None:
        """End every outstanding request with :class:`ShuttingDown` and refuse new ones; the
        engine thread stops after the pass it is in (safe in a signal handler: no waiting)."""
        self._stopping = True
        self._fail_all(ShuttingDown("the server is shutting down"))
        self._wake.set()

    def close(self, timeout: float = 30.0) -> None:
        """:meth:`stop`, and wait for the engine thread to end."""
        self.stop()
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            try:
                for event in self.engine.stream([], inbox=self.inbox, **self.stream_options):
                    self._route(event)
                    if event.done:  # every request is a new session: its KV caches are no use now
                        self.engine.close_session(event.session)
                    if self._stopping:
                        return
            except Exception as e:  # noqa: BLE001 -- the engine is broken: every request hears why
                self.error = e
                self._fail_all(e)
                return

    def _route(self, event: TokenEvent) -> None:
        with self._lock:
            route = self._routes.pop(event.session, None) if event.done else self._routes.get(event.session)
            if route is None:  # cancelled meanwhile
                return
            self._waiting.discard(event.session)
            self._update_gauges()
            # Timed before the event can reach its client: an answer is never ahead of its metrics.
            if event.token is not None:
                self.metrics.token(event.session)
            if event.done:
                self.metrics.ended(event.session)
            loop, queue = route
            pending = self._pending.setdefault(loop, [])
            pending.append((queue, event))
            wake = len(pending) == 1  # else a wake-up is on its way and will carry this one too
        if wake:
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # its event loop is closed: nobody is listening
                with self._lock:
                    self._pending.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: hand it every event routed to it so far, in order."""
        with self._lock:
            pending = self._pending.pop(loop, [])
        for queue, event in pending:
            queue.put_nowait(event)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            routes, self._routes = self._routes, {}
            self._waiting.clear()
            self._update_gauges()
        for session, (loop, queue) in routes.items():
            self.metrics.ended(session)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, TokenEvent(session, None, 0, True, error))
            except RuntimeError:  # its event loop is already closed: nobody is listening
                pass

    def _update_gauges(self) -> None:
        self.metrics.set("queued_sessions", len(self._waiting))
        self.metrics.set("running_sessions", len(self._routes) - len(self._waiting))


class _TimedInbox(Inbox):
    """The inbox, telling the metrics when the engine takes requests (their queue time ends)."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self.metrics = metrics

    def take(self) -> tuple[list[Request], list[Hashable]]:
        requests, cancelled = super().take()
        if requests:
            self.metrics.scheduled(r.session for r in requests)
        return requests, cancelled


class Encoder:
    """Sentence embeddings, one call at a time on a thread of its own (the executor and the
    pipeline are not re-entrant).  ``run`` maps graph-input batches to output dicts."""

    def __init__(self, run: Callable[[list[dict]], list[dict]]) -> None:
        self.run = run
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dist-runtime encoder")

    async def embed(self, batches: list[dict]):
        import numpy as np

        outs = await asyncio.get_running_loop().run_in_executor(self._pool, self.run, batches)
        return np.concatenate([o["sentence_embedding"] for o in outs])

    @property
    def alive(self) -> bool:
        return True

    def stop(self) -> None:
        """Nothing to end: an embedding call is short and answers before the server stops."""

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
