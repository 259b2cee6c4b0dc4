"""The server's counters and gauges, written in Prometheus' text exposition format (version
0.0.4) for ``GET /metrics``."""

from __future__ import annotations

import threading

#: name -> (type, help); every metric is exported as ``dist_runtime_<name>``.
METRICS = {
    "requests": ("counter", "HTTP API requests answered, by endpoint and status code"),
    "prompt_tokens": ("counter", "prompt tokens accepted"),
    "generated_tokens": ("counter", "tokens generated"),
    "queued_sessions": ("gauge", "sessions waiting for their first token (queued or in prefill)"),
    "running_sessions": ("gauge", "sessions generating: the batch the engine runs"),
    "stage_busy_seconds": ("counter", "seconds each pipeline stage spent computing"),
    "recoveries": ("counter", "sessions rebuilt on a pipeline stage that replaced a failed one"),
}


class Metrics:
    """Values by (name, labels); thread safe (the engine thread counts tokens)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {("queued_sessions", ()): 0, ("running_sessions", ()): 0}

    def count(self, name: str, amount: float = 1, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def set(self, name: str, value: float, **labels) -> None:
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels) -> float:
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0)

    def text(self) -> str:
        with self._lock:
            values = sorted(self._values.items())
        lines = []
        for name, (kind, help_) in METRICS.items():
            lines += [f"# HELP dist_runtime_{name} {help_}", f"# TYPE dist_runtime_{name} {kind}"]
            for (n, labels), value in values:
                if n == name:
                    tags = ",".join(f'{k}="{v}"' for k, v in labels)
                    lines.append(f"dist_runtime_{name}{{{tags}}} {value:g}" if tags else f"dist_runtime_{name} {value:g}")
        return "\n".join(lines) + "\n"
