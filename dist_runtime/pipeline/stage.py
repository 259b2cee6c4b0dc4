"""A pipeline stage: its part of the graph, its weights, its sessions' KV caches.

:class:`StageWorker` is plain Python (tests drive it in-process); :func:`stage_actor_class` wraps
it as a Ray actor, one process per stage.  Activations arrive and leave as msgpack messages
(``dist_runtime.transport``): the stage decodes its inputs, runs its ``GraphExecutor`` for the
message's session at the message's position, and encodes what later stages need -- its own
outputs plus the tensors it forwards.  Anything wrong with one message (a hostile or corrupt frame,
a missing tensor, a bad position) fails that call only; the stage keeps serving other sessions.

Per step the stage records when it started and finished (wall clock, to line stages up on one
timeline) and how long decoding, computing and encoding took (``perf_counter``); the driver
fetches the records with ``telemetry()`` and derives queue wait and transfer from them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from typing import Any, Hashable

import numpy as np

from ..arena import process_memory
from ..backends import set_threads, threads_in_use
from ..batched_pass import Segment
from ..errors import DistRuntimeError, TransportError
from ..kernels.elementwise import argmax
from ..transport import decode_message, encode_message
from .header import RECORDS_KEPT, BatchSegment, StageRecord, StepHeader
from .options import MAX_SESSIONS
from .subgraph import StageGraph
from .weights import fingerprint, held_bytes, resident_file_bytes

#: The scratch session a stage warms up on when it gets its weights (a name no driver uses:
#: the coordinator's sessions are the caller's ids, and one-off passes are "run:<step>").
WARMUP_SESSION = "warmup:stage"

#: Environment variables that cap the BLAS / OpenMP / numba pools of a stage process (numba's
#: threads run the compiled products, splitting their output rows).  They must be set
#: before numpy loads, so they go in the actor's ``runtime_env``; threadpoolctl, when installed,
#: also applies the cap to a process that has loaded numpy already.
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def thread_env(threads: int, cpus: float | None = None) -> dict[str, str]:
    """The pool caps; and when the threads exceed the stage's CPU reservation (stages that take
    turns on shared cores, e.g. one session at a time), OpenBLAS's idle threads sleep at once
    (2^4 cycles) instead of spinning for ~0.1 s on cores another stage is computing on."""
    env = {name: str(threads) for name in THREAD_ENV}
    if cpus is not None and threads > cpus:
        env["OPENBLAS_THREAD_TIMEOUT"] = "4"
    return env


def limit_threads(threads: int) -> str:
    """Cap the BLAS pool of this process at ``threads``; returns how it was done."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return "env" if os.environ.get("OPENBLAS_NUM_THREADS") == str(threads) else "none"
    threadpool_limits(threads)
    return "threadpoolctl"


class StageWorker:
    """One stage.  ``load_file`` or ``load_weights`` must succeed before ``step``."""

    def __init__(self, stage: StageGraph, *, fuse: bool = True, backends=None, seed: int = 0,
                 threads: int | None = None, max_sessions: int = MAX_SESSIONS, kv_dtype: str | None = None) -> None:
        self.stage = stage
        self._fuse, self._backends, self._seed, self._kv_dtype = fuse, backends, seed, kv_dtype
        self.threads = threads
        self.compute_threads: int | None = None  # set_threads: what placement chose, once it is known
        self.thread_limit = limit_threads(threads) if threads else "none"
        self.max_sessions = max_sessions
        self._executor = None
        self._weights: dict = {}
        self._model = None  # keeps the mapping open while the executor uses its views
        self.source: str | None = None
        self._records: deque = deque(maxlen=RECORDS_KEPT)
        self._last_end = 0.0  # wall time the previous call finished: queue wait is measured from it
        self.steps = 0
        self.errors = 0
        self.busy = 0.0  # seconds spent in steps since this process started (/metrics reads it)
        # The direct channel runs steps in its link thread while Ray calls reset, reports and
        # telemetry on the actor's main thread: one lock keeps the executor's sessions consistent.
        self._lock = threading.Lock()
        self._parked: dict[int, dict] = {}  # prefix cache entries: KV states of ended sessions, by handle
        self._link = None
        self.warmup = "not run"

    # -- weights -------------------------------------------------------------------------------
    def load_file(self, path: str, expected: str | None = None) -> dict:
        """Map this stage's tensors from ``path`` if it exists here and matches ``expected``.

        Returns ``{"loaded": bool, "reason": ...}``: a missing or different file is not an error,
        the driver then sends the weights through the object store.
        """
        if not os.path.isfile(path):
            return {"loaded": False, "reason": f"{path} does not exist on {socket.gethostname()}"}
        from ..model import load_model

        try:
            model = load_model(path, tensors=self.stage.weights, validate=False)
        except DistRuntimeError as e:  # another model, or a damaged copy: not this stage's file
            return {"loaded": False, "reason": f"{path} on {socket.gethostname()}: {e}"}
        if expected is not None and fingerprint(model, self.stage.weights) != expected:
            model.close()
            return {"loaded": False, "reason": f"{path} on {socket.gethostname()} is a different file"}
        self._model = model
        self._install(model.weights, f"file {path}")
        return {"loaded": True, "reason": "mapped"}

    def restage(self, stage: StageGraph) -> None:
        """Become ``stage`` of a re-planned pipeline, in this process (whose kernels are loaded
        already): the old stage's executor, sessions, parked entries and weights are dropped;
        ``load_file`` or ``load_weights`` comes next."""
        import gc

        with self._lock:
            self._executor, self._weights, self.source, self.warmup = None, {}, None, "not run"
            self._parked.clear()
            if self._model is not None:
                self._model.close()
                self._model = None
            self.stage = stage
            gc.collect()  # the old weights' buffers go before the new ones are copied in

    def load_weights(self, weights: dict) -> dict:
        """Use tensors sent through the object store (zero-copy, read-only views of it)."""
        missing = sorted(set(self.stage.weights) - set(weights))
        if missing:
            raise DistRuntimeError(f"stage {self.stage.index}: weights {missing[:5]} were not sent")
        self._install({n: weights[n] for n in self.stage.weights}, "object store")
        return {"loaded": True, "reason": "object store"}

    def _install(self, weights: dict, source: str) -> None:
        self._weights = dict(weights)
        self.source = source
        if self.stage.graph is not None:
            from ..executor import GraphExecutor

            # Batch-invariant: a session's rows give the same bits in any batch (continuous batching).
            # The file's pages of each weight the executor copies (a huge-page buffer) are given
            # back as soon as it is copied: the stage never holds its weights twice.
            self._executor = GraphExecutor((self.stage.graph, self._weights), self._backends,
                                           fuse=self._fuse, seed=self._seed, kv_dtype=self._kv_dtype,
                                           release=self._model.release if self._model is not None else None)
            # Hold the executor's copies rather than the file map's or the object store's views.
            self._weights = self._executor.held_weights(self._weights)
            self.warmup = self._warm_up()

    def _warm_up(self) -> str:
        """Run a prefill step and a decode step on a scratch session, then forget it, so that
        the first real request does not pay for compiling or loading kernels, or for first-touch
        page faults on the weights.  Returns what happened, for the stage's report; a failure
        here is reported, not raised (a real step with real inputs gives the real error)."""
        from ..backends.compiled import ahead
        from ..compile_notice import announce

        announce(prefix=f"stage {self.stage.index}: ")  # a cold cache compiles here
        ahead.enable()  # the program in a child meanwhile: the stage serves step by step until it is ready
        ex = self._executor
        t0 = time.perf_counter()
        try:
            for rows in (2, 1):  # a prefill, then a decode step (attention takes other paths)
                dummy = {n: _read_only(np.zeros([rows if d < 0 else d for d in spec.shape], spec.dtype.numpy))
                         for n, spec in zip(ex.graph.input_names, ex.graph.inputs)}
                ex.run(dummy, session=WARMUP_SESSION)
        except Exception as e:  # noqa: BLE001 -- reported; deployment must not fail on scratch inputs
            return f"failed: {type(e).__name__}: {e}"
        finally:
            ex.close_session(WARMUP_SESSION)
        return f"{(time.perf_counter() - t0) * 1e3:.0f} ms"

    # -- sessions ------------------------------------------------------------------------------
    def reset(self, session: Hashable | None = None) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.reset(session)

    def close_session(self, session: Hashable) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.close_session(session)

    # -- the prefix cache's entries (the coordinator holds their index: dist_runtime/prefix_cache.py)
    def park(self, session: Hashable, handle: int) -> int:
        """Keep ``session``'s KV states as entry ``handle`` (the session ends); their bytes."""
        with self._lock:
            states = self._executor.detach_kv(session) if self._executor is not None else None
            if states is None:
                return 0
            self._parked[handle] = states
            return sum(state.nbytes()[1] for state in states.values())

    def restore_parked(self, session: Hashable, handle: int, rows: int) -> None:
        """Start ``session`` from the first ``rows`` rows of entry ``handle``."""
        with self._lock:
            if self._executor is not None:
                self._executor.restore_kv(session, self._parked[handle], rows)

    def drop_parked(self, handle: int) -> None:
        with self._lock:
            self._parked.pop(handle, None)

    def sessions(self) -> list:
        with self._lock:
            return self._executor.sessions() if self._executor is not None else []

    def set_threads(self, n: int) -> int:
        """Compute on ``n`` threads from the next step on (placement's choice, made once the
        stages' nodes are known: :func:`.launch.placement_threads`), at most the cores this
        process may run on (a node may declare more CPUs to Ray than it has); returns how many."""
        self.compute_threads = max(1, min(int(n), len(os.sched_getaffinity(0))))
        return self.compute_threads

    # -- the data path -------------------------------------------------------------------------
    def step(self, message: bytes) -> bytes:
        """Decode, run, encode.  Raises ``TransportError`` for a malformed message, and the
        executor's ``DistRuntimeError`` (``GraphValidationError``, ``KernelError``) for a
        well-formed one this stage cannot run; either fails this call only."""
        start = time.time()
        t0 = time.perf_counter()
        try:
            tensors, meta = decode_message(message)
            if meta.get("warmup") is True and not tensors:  # a channel warming up: no work, no record
                return encode_message({}, {"warmup": True})
            header = StepHeader.from_meta(meta)
            if set(tensors) != set(self.stage.receives):
                raise TransportError(
                    f"stage {self.stage.index} receives {list(self.stage.receives)}, the message "
                    f"holds {sorted(tensors)}")
            with self._lock:
                t1 = time.perf_counter()
                if self.compute_threads:  # numba's thread count is per calling thread
                    set_threads(self.compute_threads)
                outputs = self._run(tensors, header)
                t2 = time.perf_counter()
            reply = encode_message(outputs, header.to_meta())
        except BaseException:
            self.errors += 1
            self._last_end = time.time()
            self.busy += self._last_end - start
            raise
        t3 = time.perf_counter()
        end = time.time()
        with self._lock:
            self._records.append(StageRecord(header.step, header.session, start, end, t1 - t0, t2 - t1, t3 - t2,
                                             self._last_end))
            self._last_end = end
            self.steps += 1
            self.busy += end - start
        return reply

    def _run(self, tensors: dict, header: StepHeader) -> dict:
        stage, ex = self.stage, self._executor
        segments = header.batch or (BatchSegment(header.session, header.pos, 0, header.reset, header.ceiling),)
        outputs = {name: tensors[name] for name in stage.forwards}
        logits, rows = stage.logits, None
        cut = logits is not None and header.logits != "all"
        ends = np.cumsum([seg.rows for seg in segments]) - 1 if header.batch else [-1]
        if ex is not None:
            known = ex.sessions()
            new = {seg.session for seg in segments} - set(known)
            if len(known) + len(new) > self.max_sessions:
                raise DistRuntimeError(f"stage {stage.index} already holds {len(known)} sessions "
                                       f"(at most {self.max_sessions})")
            for seg in segments:
                if seg.reset:
                    ex.reset(seg.session)
                if seg.ceiling:
                    ex.set_kv_ceiling(seg.session, seg.ceiling)
            inputs = {n: tensors[n] for n in stage.executor_inputs}
            # the driver samples from each session's last row only: where the logits are all this
            # stage makes, its last steps run on those rows alone (GraphExecutor.run's rows=)
            first = next(iter(inputs.values()), None)
            if cut and list(ex.graph.outputs) == [logits] and np.ndim(first):
                rows = ends if header.batch else [len(first) - 1]
            if header.batch:
                outputs.update(ex.run_batch(inputs, [Segment(seg.session, seg.rows, seg.pos) for seg in segments],
                                            rows=rows))
            else:
                outputs.update(ex.run(inputs, session=header.session, pos=header.pos, rows=rows))
            if header.close:  # a one-off pass (Coordinator.run): keep no session state
                ex.close_session(header.session)
        elif self.source is None and stage.weights:
            raise DistRuntimeError(f"stage {stage.index} has no weights loaded")
        if cut and logits in outputs:
            if rows is None:
                outputs[logits] = outputs[logits][ends]
            if header.logits == "argmax":  # greedy sessions: their tokens, chosen as Sampling.choose does
                outputs[logits] = argmax(outputs[logits]).astype(np.int32)
        return {name: outputs[name] for name in stage.sends}

    # -- reports -------------------------------------------------------------------------------
    def telemetry(self, first_step: int = 0) -> list[StageRecord]:
        """Records since the last call, of steps ``first_step`` and later (the older ones the
        driver no longer keeps are not sent)."""
        with self._lock:
            records = [r for r in self._records if r.step >= first_step]
            self._records.clear()
        return records

    def report(self) -> dict[str, Any]:
        """Who and where this stage is, and what it holds."""
        path = getattr(self._model, "path", None)
        return {
            "stage": self.stage.index, "host": socket.gethostname(), "pid": os.getpid(),
            "node_id": _node_id(), "source": self.source, "weights": list(self._weights),
            "weight_bytes": held_bytes(self._weights),
            "resident_file_bytes": resident_file_bytes(path) if path is not None else None,
            "threads": self.threads, "thread_limit": self.thread_limit, "nice": os.nice(0),
            "blas_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
            "compiled_threads": threads_in_use(),
            "sessions": len(self.sessions()), "steps": self.steps, "errors": self.errors,
            "warmup": self.warmup,
            # why this stage runs one session per pass, or None when sessions share passes
            "batching": self._executor.rows.reason if self._executor is not None else None,
            "placement": self._executor.placement.reason if self._executor is not None else None,
            "memory": self.memory(),
        }

    def memory(self) -> dict[str, Any]:
        """This stage's process: resident bytes now and at peak, its weights' bytes, and its KV
        caches' bytes in use and reserved; beside them ``busy_seconds``, the seconds it has spent
        in steps since it started (read with the memory: one call when /metrics is scraped)."""
        own = self._executor.memory() if self._executor is not None else {
            **(process_memory() or {}), "kv_in_use": 0, "kv_reserved": 0}
        return {**own, "weights": held_bytes(self._weights), "busy_seconds": self.busy}

    # -- the direct channel's link (see links.py) -----------------------------------------------
    def open_link(self, token: bytes) -> tuple[str, int]:
        """Listen for the upstream hop; returns the address to give it."""
        from .links import StageLink

        self.close_link()
        self._link = StageLink(self.stage.index, self.step, token)
        return self._link.address

    def link_to(self, host: str, port: int) -> None:
        """Connect to the downstream hop and start serving frames."""
        self._link.connect_downstream(host, port)

    def close_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def ping(self, payload=None):
        """A plain round trip (the benchmark's baseline)."""
        return payload


def _read_only(a: np.ndarray) -> np.ndarray:
    """As a message's tensors arrive (read-only views of the frame): compiled kernels specialise
    on that, so a warm-up with writable arrays would leave the real first step cold."""
    a.flags.writeable = False
    return a


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 -- a report must not fail on a missing runtime context
        return None


def stage_actor_class():
    """``StageWorker`` as a Ray actor class (built on demand: importing this module needs no Ray)."""
    import ray

    return ray.remote(StageWorker)
