"""The server's metrics for ``GET /metrics``, on prometheus-client: counters, gauges, latency and
length histograms of the engine requests, and each pipeline stage's memory beside the plan's
estimate (read when scraped).

Every :class:`Metrics` has a registry of its own, never the process-wide default: tests start many
servers in one process, and each must count only its own requests.  The engine thread and the
event loop both record; prometheus-client's objects are thread safe, and the per-request times
below are kept under a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dist_runtime_"

#: name -> (help, labels); exported as ``dist_runtime_<name>_total`` (prometheus-client adds it).
COUNTERS = {
    "requests": ("HTTP API requests answered, by endpoint and status code", ("endpoint", "status")),
    "prompt_tokens": ("prompt tokens accepted", ()),
    "generated_tokens": ("tokens generated", ()),
}
GAUGES = {
    "queued_sessions": "sessions waiting for their first token (queued or in prefill)",
    "running_sessions": "sessions generating: the batch the engine runs",
}

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards and alerts written for it read
# these alike.  Inter-token latency adds 1 ms and 5 ms below vLLM's first bucket: a small model on
# CPU makes tokens faster than 10 ms.  Queue time is part of the time to first token: its buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
DEFAULT_MAX_LENGTH = 100_000  # lengths' buckets when the model states no context

#: name -> (help, buckets; None: lengths, 1-2-5 up to the context)
HISTOGRAMS = {
    "time_to_first_token_seconds": ("seconds from a request's arrival to its first token", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("seconds between two consecutive tokens of a request", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("seconds from a request's arrival to its end", REQUEST_BUCKETS),
    "request_queue_time_seconds": ("seconds from a request's arrival until the engine took it", TTFT_BUCKETS),
    "request_prompt_tokens": ("prompt tokens of a request", None),
    "request_generation_tokens": ("tokens a request generated", None),
}

#: What the collectors of watch_memory and watch_pipeline export, read when scraped.
WATCHED = ("stage_memory_bytes", "stage_memory_planned_bytes", "stage_busy_seconds", "recoveries", "replans",
           "replan_seconds")

#: How long a scrape waits for the stages' memory before it shows the last values read.
MEMORY_WAIT = 1.0


def length_buckets(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``most`` (vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class _Times:
    """One engine request's moments so far (``time.monotonic()``)."""
    arrival: float
    prompt: int
    last: float | None = None  # its latest token
    tokens: int = 0


class Metrics:
    """The server's metrics (see the module docstring); ``max_length``: the model's context, the
    top of the length histograms' buckets."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_length: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for name, (help_, labels) in COUNTERS.items():
            self._metrics[name] = Counter(PREFIX + name, help_, labels, registry=self.registry)
        for name, help_ in GAUGES.items():
            self._metrics[name] = Gauge(PREFIX + name, help_, registry=self.registry)
        lengths = length_buckets(max_length or DEFAULT_MAX_LENGTH)
        for name, (help_, buckets) in HISTOGRAMS.items():
            self._metrics[name] = Histogram(PREFIX + name, help_, buckets=buckets or lengths, registry=self.registry)
        self._lock = threading.Lock()
        self._requests: dict[Hashable, _Times] = {}
        self._memory: StageMemory | None = None

    # -- plain values ----------------------------------------------------------------------------
    def count(self, name: str, amount: float = 1, **labels) -> None:
        self._labelled(name, labels).inc(amount)

    def set(self, name: str, value: float, **labels) -> None:
        self._labelled(name, labels).set(value)

    def observe(self, name: str, value: float) -> None:
        self._metrics[name].observe(value)

    def get(self, name: str, **labels) -> float:
        """A counter's or gauge's value now (0 when never set); a histogram's count; a watched
        value (the stages', the pipeline's) as a scrape reads it.  A name that is neither is a
        ``KeyError``, not 0."""
        if name not in self._metrics and name not in WATCHED:
            raise KeyError(f"no metric {name!r}")
        wanted = {k: str(v) for k, v in labels.items()}
        names = {PREFIX + name + suffix for suffix in ("", "_total", "_count")}
        for family in self._metrics[name].collect() if name in self._metrics else self.registry.collect():
            for sample in family.samples:
                if sample.name in names and sample.labels == wanted:
                    return sample.value
        return 0

    def text(self) -> str:
        """Everything, in the exposition format of :attr:`content_type`."""
        return generate_latest(self.registry).decode()

    def _labelled(self, name: str, labels: dict):
        metric = self._metrics[name]
        return metric.labels(**{k: str(v) for k, v in labels.items()}) if labels else metric

    # -- an engine request's moments (the bridge reports them) -----------------------------------
    def arrived(self, session: Hashable, prompt_tokens: int) -> None:
        with self._lock:
            self._requests[session] = _Times(time.monotonic(), prompt_tokens)

    def scheduled(self, sessions: Iterable[Hashable]) -> None:
        """The engine took ``sessions`` into its batching (before its next pass)."""
        now = time.monotonic()
        with self._lock:
            waited = [now - self._requests[s].arrival for s in sessions if s in self._requests]
        for seconds in waited:
            self.observe("request_queue_time_seconds", seconds)

    def token(self, session: Hashable) -> None:
        """``session`` generated a token: counted, and timed from its arrival or previous token."""
        self.count("generated_tokens")
        now = time.monotonic()
        with self._lock:
            times = self._requests.get(session)
            if times is None:  # it ended meanwhile (cancelled)
                return
            since, first = (times.arrival, True) if times.last is None else (times.last, False)
            times.last, times.tokens = now, times.tokens + 1
        self.observe("time_to_first_token_seconds" if first else "inter_token_latency_seconds", now - since)

    def ended(self, session: Hashable) -> None:
        """``session`` left the engine: finished, stopped by a stop string, cancelled or failed."""
        with self._lock:
            times = self._requests.pop(session, None)
        if times is not None:
            self.observe("e2e_request_latency_seconds", time.monotonic() - times.arrival)
            self.observe("request_prompt_tokens", times.prompt)
            self.observe("request_generation_tokens", times.tokens)

    # -- memory ------------------------------------------------------------------------------------
    def watch_memory(self, read: Callable[[], list[dict]], planned: Callable[[], list[dict]] | None = None,
                     wait: float = MEMORY_WAIT) -> None:
        """Export each stage's memory, ``read()`` when scraped (a dict of bytes by kind per
        stage), and ``planned()``, the plan's estimate per stage, also when scraped (a re-plan
        changes it; see :class:`StageMemory`); it replaces what an earlier call watched (one
        backend's memory at a time)."""
        if self._memory is not None:
            self.registry.unregister(self._memory)
        self._memory = StageMemory(read, planned or list, wait)
        self.registry.register(self._memory)

    def watch_pipeline(self, replans: Callable[[], list], recoveries: Callable[[], int]) -> None:
        """Export the pipeline's re-plans (``replans()``: the ``Replan`` records so far) and
        recoveries (``recoveries()``: sessions rebuilt so far), read when scraped: a server's
        stream may never end, and a drain while no request runs counts at once."""
        self.registry.register(PipelineEvents(replans, recoveries))


class PipelineEvents:
    """A collector: ``dist_runtime_recoveries_total``, ``dist_runtime_replans_total{trigger}``
    and ``dist_runtime_replan_seconds_total{phase}``, from the coordinator's records."""

    def __init__(self, replans: Callable[[], list], recoveries: Callable[[], int]) -> None:
        self.replans, self.recoveries = replans, recoveries

    def describe(self):
        return []

    def collect(self):
        yield CounterMetricFamily(PREFIX + "recoveries", "sessions rebuilt on a pipeline stage that replaced a "
                                  "failed one", value=self.recoveries())
        records = list(self.replans())
        count = CounterMetricFamily(PREFIX + "replans", "times the pipeline was planned again over other nodes, "
                                    "by trigger", labels=("trigger",))
        seconds = CounterMetricFamily(PREFIX + "replan_seconds", "seconds the pipeline's re-plans took, by "
                                      "phase (detect, plan, load, replay)", labels=("phase",))
        for trigger in sorted({r.trigger for r in records}):
            count.add_metric((trigger,), sum(r.trigger == trigger for r in records))
        for phase in sorted({p for r in records for p in r.seconds}):
            seconds.add_metric((phase,), sum(r.seconds.get(phase, 0.0) for r in records))
        yield count
        yield seconds


class StageMemory:
    """A collector: ``dist_runtime_stage_memory_bytes{stage, kind}`` and
    ``dist_runtime_stage_busy_seconds_total{stage}`` read when scraped, and
    ``dist_runtime_stage_memory_planned_bytes{stage, kind}``, the plan's estimate.

    One read runs at a time, on a thread of its own; a scrape waits for it at most ``wait``
    seconds, then shows the last values read (a busy or dead stage must not hold /metrics up, nor
    scrapes pile reads on it).  A read that fails keeps the last values too.
    """

    def __init__(self, read: Callable[[], list[dict]], planned: Callable[[], list[dict]], wait: float) -> None:
        self.read, self.planned, self.wait = read, planned, wait
        self._lock = threading.Lock()
        self._last: list[dict] = []
        self._reading: threading.Thread | None = None

    def describe(self):
        return []  # nothing to check at registration: its names are its own

    def collect(self):
        latest = self._latest()
        yield _family("stage_memory_bytes", "bytes each pipeline stage's process holds, by kind "
                      "(resident, peak, weights, kv_in_use, kv_reserved)",
                      [{kind: v for kind, v in kinds.items() if kind != "busy_seconds"} for kinds in latest])
        busy = CounterMetricFamily(PREFIX + "stage_busy_seconds", "seconds each pipeline stage's process has "
                                   "spent in steps (from 0 again when a stage's process is new)", labels=("stage",))
        for k, kinds in enumerate(latest):
            if "busy_seconds" in kinds:
                busy.add_metric((str(k),), kinds["busy_seconds"])
        if busy.samples:  # a pipeline's stages: one process serving has none
            yield busy
        planned = self.planned()
        if planned:
            yield _family("stage_memory_planned_bytes", "the plan's estimate of each stage's memory, by kind "
                          "(weights, kv, activations, reserve, total, budget)", planned)

    def _latest(self) -> list[dict]:
        with self._lock:
            if self._reading is None or not self._reading.is_alive():
                self._reading = threading.Thread(target=self._refresh, name="dist-runtime memory", daemon=True)
                self._reading.start()
            reading = self._reading
        reading.join(self.wait)
        with self._lock:
            return self._last

    def _refresh(self) -> None:
        try:
            values = self.read()
        except Exception:  # noqa: BLE001 -- a stage died or is being replaced: the last values stand
            return
        with self._lock:
            self._last = values


def _family(name: str, help_: str, stages: list[dict]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, help_, labels=("stage", "kind"))
    for k, kinds in enumerate(stages):
        for kind, value in kinds.items():
            if isinstance(value, (int, float)):  # not the pipeline's nested "plan"
                family.add_metric((str(k), kind), value)
    return family
