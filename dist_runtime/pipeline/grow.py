"""Growing a running pipeline onto nodes that join the cluster.

A thread looks at the cluster's nodes every ``poll`` seconds.  A node that joined after the
pipeline was placed, hosts no stage and was not drained is a candidate when it has what a stage
asks for: its CPUs, and the pipeline's resource label when the stages were pinned by one (one
shared label, e.g. ``--stage-resources pool,pool,pool``).  A node that lacks them is ignored, with
a log line saying why.  The pipeline is re-planned onto a candidate -- at a safe point, by the
coordinator, every session replayed -- when the new plan's bottleneck is at least ``GAIN`` lower
than the current one's.
"""

from __future__ import annotations

import logging
import threading
from fractions import Fraction

from .replan import Replan

log = logging.getLogger("dist_runtime.elastic")

#: How much lower the bottleneck of a plan with the new node must be for the pipeline to move.
GAIN = Fraction(1, 10)
#: Seconds between two looks at the cluster's nodes.
POLL = 2.0


class NodeWatch:
    """Grows ``pipe`` (a ``Pipeline``) onto the nodes that join; ``close()`` stops it."""

    def __init__(self, pipe, poll: float = POLL) -> None:
        self.pipe, self.poll = pipe, poll
        self.seen: set[str] = {n["NodeID"] for n in _alive()}  # there before: not joins
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dist-runtime node watch", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 -- a failed grow leaves the pipeline as it was
                log.warning("a node joined but the pipeline could not grow onto it: %s", e)

    def check(self) -> Replan | None:
        """Grow onto the first new node that is worth it; the re-plan, or None."""
        pipe = self.pipe
        for node in _alive():
            nid = node["NodeID"]
            if nid in self.seen or nid in pipe.drained or self._stop.is_set():
                continue
            self.seen.add(nid)
            lacks = _lacks(node["Resources"], pipe.options)
            if lacks:
                log.warning("node %s joined: ignored, it has no %s a stage asks for", nid[:12], lacks)
                continue
            now = Fraction(pipe.plan.bottleneck)
            then = Fraction(pipe._plan_over(list(range(len(pipe.stages))), [nid]).bottleneck)
            if then > (1 - GAIN) * now:
                log.warning("node %s joined: ignored, a plan over it would lower the bottleneck by %.0f%% "
                            "(at least %.0f%% moves the pipeline)", nid[:12], 100 * float(1 - then / now),
                            100 * float(GAIN))
                continue
            return pipe.grow(nid)
        return None


def _alive() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def _lacks(resources: dict, options) -> str:
    """What of a stage's ask the node has not (empty: nothing); a stage pinned by per-stage labels
    (stage0, stage1, ...) has no label a new node could carry."""
    labels = options.resources or []
    if any(r != labels[0] for r in labels):
        return "per-stage label (--stage-resources names one per stage)"
    ask = {"CPU": options.cpus or 0, **(labels[0] if labels else {})}
    short = [f"{amount:g} {name}" for name, amount in ask.items() if resources.get(name, 0) < amount]
    return " and ".join(short)
