"""A served model: its backend (engine thread or encoder, in this process or on pipeline stages),
the app, and uvicorn serving it -- in the foreground (``dist-runtime serve``) or on a thread (the
demo, the tests).

The socket is bound before uvicorn starts, so the URL (and an ephemeral port, ``port=0``) is known
at once.  Stopping (SIGTERM, Ctrl-C, :meth:`Server.stop`) first ends every running stream with an
error event, so that uvicorn's graceful shutdown does not wait on them, then closes the engine
thread and whatever ``on_close`` names (a pipeline: its actors and an embedded Ray).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import uvicorn

from ..errors import DistRuntimeError
from ..scheduling_defaults import DEFAULT_PREFIX_CACHE
from ..units import parse_bytes
from .api import create_app
from .bridge import EngineBridge, Encoder
from .metrics import Metrics
from .served_model import ServedModel

#: Seconds a read of the stages' memory may take (a scrape shows the last values meanwhile).
MEMORY_TIMEOUT = 30.0
#: Step records a served pipeline's stream keeps (``Coordinator.last_run``, for whoever inspects it):
#: the stream of a busy server may run for days.
SERVE_STEPS = 4096


def local_backend(model: ServedModel, metrics: Metrics, *, max_batch_tokens: int, max_queue: int,
                  fuse: bool = True, kv_dtype: str | None = None, numerics: str | None = None,
                  prefix_cache: int | None = None) -> EngineBridge | Encoder:
    """The model in this process: a continuously batched ``LocalEngine`` (with a prefix cache of
    ``prefix_cache`` bytes; None: the CLI's default; 0: none), or an encoder."""
    from ..engine import LocalEngine, kv_pool_rows
    from ..executor import GraphExecutor
    from ..prefix_cache import PrefixCache

    if model.kind == "embed":
        executor = GraphExecutor(model.path, fuse=fuse)
        metrics.watch_memory(_process_memory(executor, model))
        return Encoder(lambda batches: [executor.run(b) for b in batches])
    executor = GraphExecutor(model.path, fuse=fuse, kv_dtype=kv_dtype, numerics=numerics)
    metrics.watch_memory(_process_memory(executor, model))
    if prefix_cache is None:
        prefix_cache = parse_bytes(DEFAULT_PREFIX_CACHE)
    engine = LocalEngine(executor, max_batch_tokens=max_batch_tokens,
                         prefix_cache=PrefixCache(prefix_cache) if prefix_cache else None,
                         max_kv_rows=kv_pool_rows(executor, held_back=prefix_cache))
    return EngineBridge(engine, metrics, max_queue=max_queue)


def pipeline_backend(model: ServedModel, pipe, metrics: Metrics, *, max_queue: int,
                     max_in_flight: int | None = None) -> EngineBridge | Encoder:
    """The model on a deployed ``Pipeline``'s stages; each scrape of the metrics reads the stages'
    memory and busy seconds and the coordinator's recoveries and re-plans."""
    coordinator = pipe.coordinator
    metrics.watch_memory(lambda: pipe.memory(timeout=MEMORY_TIMEOUT),
                         planned=lambda: [_planned(st.memory) for st in pipe.plan.stages])
    if model.kind == "embed":
        return Encoder(coordinator.run_many)
    metrics.watch_pipeline(lambda: coordinator.replans, lambda: len(coordinator.recoveries))
    return EngineBridge(coordinator, metrics, max_queue=max_queue,
                        stream_options={"max_in_flight": max_in_flight, "telemetry_steps": SERVE_STEPS})


def pipeline_health(pipe) -> Callable[[], str | dict | None]:
    """/health of a deployed ``Pipeline``: a recovery under way (the coordinator's snapshot, read
    without calling the stages), else the stages that do not answer a ping (down), else None."""
    coordinator = pipe.coordinator

    def health() -> str | dict | None:
        recovering = coordinator.recovering()
        if recovering is None:
            dead = coordinator.dead_stages()
            # The engine thread may have noticed the same dead stage while the pings were out:
            # then it is being replaced, not down.
            recovering = coordinator.recovering()
            if recovering is None:
                return f"stage(s) {', '.join(map(str, dead))} do not answer" if dead else None
        return {"status": "recovering", **recovering.describe()}

    return health


class PipelineAdmin:
    """What an operator does to a served pipeline over HTTP (/admin): see its stages, drain a node."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe

    def state(self) -> dict:
        pipe = self.pipe
        return {"stages": [{"stage": r.get("stage"), "node": r.get("node_id"), "host": r.get("host")}
                           for r in pipe.reports],
                "drained": sorted(pipe.drained), "replans": [r.describe() for r in pipe.coordinator.replans]}

    def drain(self, node: str) -> dict:
        """Re-plan without ``node`` once the passes in flight are back (``Pipeline.drain``)."""
        return self.pipe.drain(node).describe()


def _process_memory(executor, model: ServedModel) -> Callable[[], list[dict]]:
    """The one-process server's memory as one stage: the executor's (resident, peak, KV caches)
    and the model's weights, as stored."""
    from ..model import load_model

    with load_model(model.path, tensors=[]) as m:
        weights = sum(spec.size for spec in m.index.values())

    def read() -> list[dict]:
        for _ in range(3):  # the engine thread may add a session while its KV caches are summed
            try:
                return [{**executor.memory(), "weights": weights}]
            except RuntimeError:
                continue
        raise RuntimeError("the sessions kept changing while their KV caches were summed")

    return read


def _planned(memory) -> dict:
    """A plan's ``StageMemory`` as bytes by kind (no budget: unlimited)."""
    kinds = {"weights": memory.weights, "kv": memory.kv, "activations": memory.activations,
             "reserve": memory.reserve, "total": memory.total}
    return kinds | ({"budget": memory.budget} if memory.budget is not None else {})


class Server:
    """``backend`` served as ``model`` on ``host:port`` (see the module docstring)."""

    def __init__(self, model: ServedModel, backend: EngineBridge | Encoder, metrics: Metrics, *,
                 host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 keep_alive: float = 10.0, health: Callable[[], str | dict | None] | None = None,
                 on_close: Callable[[], None] | None = None, admin: PipelineAdmin | None = None) -> None:
        self.model, self.backend, self.on_close = model, backend, on_close
        self.app = create_app(model, backend, metrics, api_key=api_key, keep_alive=keep_alive, health=health,
                              admin=admin)
        try:
            self.socket = socket.create_server((host, port))
            # Accepted connections inherit it.  asyncio sets it only on sockets whose proto is
            # IPPROTO_TCP, and create_server's is 0: without it, Nagle held each answer after
            # the first on a kept-alive connection (and each streamed token) for the client's
            # delayed ACK, ~40 ms.
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:  # in use, not ours, not an address: one line, before anything starts
            raise DistRuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        bound = self.socket.getsockname()[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=10)
        self.uvicorn = _Uvicorn(config, on_exit=backend.stop)
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        """Serve until SIGTERM or Ctrl-C (in the main thread) or :meth:`stop`; then close."""
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.close()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve on a thread; returns once requests are answered."""
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                        name="dist-runtime server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """End the streams, stop serving (the thread of :meth:`start`), close."""
        self.backend.stop()
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.close()

    def close(self) -> None:
        self.backend.close()
        self.socket.close()
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Uvicorn(uvicorn.Server):
    """uvicorn, ending the running streams as soon as it is told to exit (a signal)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)
