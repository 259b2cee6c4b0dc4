"""Per stage and step timings, run figures, the ``--stats`` table and the SVG timeline.

Each stage records, per step, when it started and finished (wall clock) and how long it spent
decoding the message, computing and encoding the reply.  The driver records when it submitted a
step and when the last stage's reply was in its hands.  Joining the two:

* **queue wait** at stage k: how long the step's input was ready while stage k was still busy
  with an earlier call: ``min(start, previous call's end) - ready``, at least 0, where ``ready``
  is the end of stage k-1 (the driver's submit time for stage 0);
* **transfer**: the rest of the gap, ``start - ready - queue``: Ray's scheduling, moving the bytes,
  and the receiving process picking the call up;
* **return**: from the last stage's end to the driver holding the reply;
* **bubble %** of a stage: the share of the run's wall time it was not busy.

Wall clocks of different machines differ by their synchronisation error (NTP/chrony: typically
well under a millisecond on one network); decode, compute and encode are local durations and exact.
"""

from __future__ import annotations

import colorsys
import statistics
from dataclasses import dataclass, field
from html import escape
from typing import Hashable

from ..partitioner.svg import fit, text_width
from .header import RECORDS_KEPT, StageRecord
from .replan import PHASES, Replan


@dataclass
class StageTiming:
    stage: int
    start: float
    end: float
    decode: float
    compute: float
    encode: float
    queue: float = 0.0
    transfer: float = 0.0


@dataclass
class StepRecord:
    step: int
    sessions: tuple  # whose rows the pass carried (one, or a batch's)
    kind: str  # "prefill" (some rows of a prompt) or "decode" (one new row per session)
    rows: int  # tokens in the step
    submit: float
    queued: int = 0  # sessions waiting for admission when it was submitted
    slot: int = 0  # passes already in flight when it was submitted (its micro-batch)
    done: float | None = None
    sample: float = 0.0  # seconds the driver spent choosing the tokens
    sampled: int = 0  # tokens it produced
    stages: list[StageTiming] = field(default_factory=list)
    error: str | None = None

    @property
    def session(self) -> Hashable:
        """The session of a one-session step; a batch's label otherwise."""
        return self.sessions[0] if len(self.sessions) == 1 else f"batch of {len(self.sessions)}"

    @property
    def returned(self) -> float | None:
        if self.done is None or not self.stages:
            return None
        return self.done - self.stages[-1].end


class RunTelemetry:
    """Everything measured in one run (``Coordinator.stream`` / ``generate``)."""

    def __init__(self, num_stages: int, max_steps: int = RECORDS_KEPT, micro_batches: int = 1) -> None:
        self.num_stages = num_stages
        self.micro_batches = micro_batches
        self.max_steps = max_steps
        self.steps: dict[int, StepRecord] = {}
        self.first_token: dict[Hashable, float] = {}
        self.session_start: dict[Hashable, float] = {}
        self.tokens: dict[Hashable, list] = {}  # per session: [first token's time, last's, count]
        self._idle_from: dict[tuple[int, int], float] = {}  # (stage, step) -> end of its previous call
        self.replans: list[Replan] = []  # re-plans during the run (the pipeline's stages changed)

    # -- recording -----------------------------------------------------------------------------
    def submitted(self, step: int, sessions, kind: str, rows: int, at: float, queued: int = 0, slot: int = 0) -> None:
        self.steps[step] = StepRecord(step, tuple(sessions), kind, rows, at, queued, slot)
        for session in sessions:
            if session not in self.session_start:
                self.session_start[session] = at
                if len(self.session_start) > self.max_steps:  # a server's sessions never end
                    oldest = next(iter(self.session_start))
                    for seen in (self.session_start, self.first_token, self.tokens):
                        seen.pop(oldest, None)
        if len(self.steps) > self.max_steps:
            self.steps.pop(next(iter(self.steps)))

    def token(self, step: int, at: float, sample_seconds: float, sessions=None) -> None:
        """Step ``step``'s reply was in hand at ``at``; ``sessions`` got a token each (default:
        every session of the step)."""
        rec = self.steps.get(step)
        if rec is None:  # dropped while in flight (max_steps)
            return
        sessions = rec.sessions if sessions is None else sessions
        rec.done, rec.sample, rec.sampled = at, sample_seconds, len(sessions)
        for session in sessions:
            if session not in self.session_start:  # dropped (max_steps): a session of long ago
                continue
            self.first_token.setdefault(session, at)
            seen = self.tokens.setdefault(session, [at, at, 0])
            seen[1], seen[2] = at, seen[2] + 1

    def replanned(self, replan: Replan) -> None:
        self.replans.append(replan)

    def failed(self, step: int, at: float, error: BaseException) -> None:
        rec = self.steps.get(step)
        if rec is not None:
            rec.done, rec.error = at, f"{type(error).__name__}: {error}"

    def add_stage_records(self, stage: int, records: list[StageRecord]) -> None:
        """Records from ``StageWorker.telemetry()``; steps of other runs are ignored."""
        for r in records:
            rec = self.steps.get(r.step)
            if rec is not None:
                rec.stages.append(StageTiming(stage, r.start, r.end, r.decode, r.compute, r.encode))
                self._idle_from[(stage, r.step)] = r.previous_end

    def finish(self) -> None:
        """Join driver and stage records: queue wait and transfer of every stage of every step."""
        for rec in self.steps.values():
            rec.stages.sort(key=lambda t: t.stage)
            ready = rec.submit
            for t in rec.stages:
                idle_from = self._idle_from.get((t.stage, rec.step), 0.0)
                t.queue = max(0.0, min(t.start, idle_from) - ready)
                t.transfer = max(0.0, t.start - ready - t.queue)
                ready = t.end

    # -- figures -------------------------------------------------------------------------------
    def window(self) -> tuple[float, float]:
        done = [r.done for r in self.steps.values() if r.done is not None]
        if not done:
            return 0.0, 0.0
        return min(r.submit for r in self.steps.values()), max(done)

    def summary(self) -> dict:
        t0, t1 = self.window()
        wall = max(t1 - t0, 1e-9)
        ok = [r for r in self.steps.values() if r.error is None and r.done is not None]
        generated = sum(r.sampled for r in ok)
        decode_tokens = sum(r.sampled for r in ok if r.kind == "decode")
        firsts = [self.first_token[s] - self.session_start[s] for s in self.first_token]
        starts = list(self.first_token.values())
        decode_wall = t1 - min(starts) if starts else 0.0
        per_session = [(n - 1) / (last - first) for first, last, n in self.tokens.values() if n > 1 and last > first]
        stages = []
        for k in range(self.num_stages):
            timings = [t for r in ok for t in r.stages if t.stage == k]
            busy = sum(min(t.end, t1) - max(t.start, t0) for t in timings if t.end > t0 and t.start < t1)
            stages.append({
                "stage": k, "steps": len(timings),
                **{what: _mean_ms([getattr(t, what) for t in timings])
                   for what in ("queue", "transfer", "decode", "compute", "encode")},
                "busy_pct": 100.0 * busy / wall, "bubble_pct": 100.0 * (1 - busy / wall),
            })
        bubble = statistics.fmean(s["bubble_pct"] for s in stages) if stages else 0.0
        return {
            "sessions": len(self.session_start), "steps": len(self.steps), "tokens": generated,
            "errors": sum(1 for r in self.steps.values() if r.error), "wall_s": wall,
            "tokens_per_s": generated / wall,
            "decode_tokens_per_s": decode_tokens / decode_wall if decode_wall > 0 else 0.0,
            "session_decode_tokens_per_s": statistics.fmean(per_session) if per_session else 0.0,
            "ttft_ms_mean": 1e3 * statistics.fmean(firsts) if firsts else 0.0,
            "ttft_ms_max": 1e3 * max(firsts) if firsts else 0.0,
            "bubble_pct": bubble,
            "return_ms": _mean_ms([r.returned for r in ok if r.returned is not None]),
            "sample_ms": _mean_ms([r.sample for r in ok]),
            "micro_batches": self.micro_batches,
            "batch_sessions_mean": statistics.fmean(len(r.sessions) for r in ok) if ok else 0.0,
            "batch_sessions_max": max((len(r.sessions) for r in ok), default=0),
            "batch_rows_mean": statistics.fmean(r.rows for r in ok) if ok else 0.0,
            "queue_max": max((r.queued for r in self.steps.values()), default=0),
            "stages": stages,
            "replans": [r.describe() for r in self.replans],
        }

    def table(self) -> str:
        s = self.summary()
        head = ("stage", "steps", "queue ms", "transfer ms", "decode ms", "compute ms", "encode ms", "busy %", "bubble %")
        rows = [head] + [(
            str(st["stage"]), str(st["steps"]), *(f"{st[k]:.3f}" for k in ("queue", "transfer", "decode", "compute", "encode")),
            f"{st['busy_pct']:.1f}", f"{st['bubble_pct']:.1f}") for st in s["stages"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"{s['tokens']} tokens from {s['sessions']} session(s) in {s['wall_s']:.3f} s: "
            f"{s['tokens_per_s']:.1f} tok/s (decode {s['decode_tokens_per_s']:.1f} tok/s aggregate, "
            f"{s['session_decode_tokens_per_s']:.1f} per session); time to first token "
            f"{s['ttft_ms_mean']:.1f} ms mean, {s['ttft_ms_max']:.1f} ms max; pipeline bubble "
            f"{s['bubble_pct']:.1f}%; driver: return {s['return_ms']:.3f} ms, sampling "
            f"{s['sample_ms']:.3f} ms per step; {s['batch_sessions_mean']:.1f} sessions and "
            f"{s['batch_rows_mean']:.1f} rows per step (max {s['batch_sessions_max']} sessions), "
            f"{s['micro_batches']} micro-batch(es) in flight, queue up to {s['queue_max']}"
            + (f"; {s['errors']} failed step(s)" if s["errors"] else ""))
        lines += [r.line() for r in self.replans]
        return "\n".join(lines)

    def svg(self, width: int = 1100) -> str:
        return timeline_svg(self, width)

    def trace(self) -> dict:
        """The run as Chrome trace-event JSON (what ``ray timeline`` writes; open it in Perfetto or
        chrome://tracing): one complete event per step and stage, one per sampling on the driver,
        times in microseconds from the run's start."""
        t0, _ = self.window()
        lanes = ["driver"] + [f"stage {k}" for k in range(self.num_stages)]
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": name}}
                              for i, name in enumerate(lanes)]
        for rec in self.steps.values():
            about = {"step": rec.step, "kind": rec.kind, "rows": rec.rows, "sessions": [str(s) for s in rec.sessions],
                     "queued": rec.queued}
            name = f"{rec.kind} x{len(rec.sessions)}"
            for t in rec.stages:
                events.append({"name": name, "cat": rec.kind, "ph": "X", "pid": t.stage + 1, "tid": 0,
                               "ts": 1e6 * (t.start - t0), "dur": 1e6 * (t.end - t.start),
                               "args": {**about, **{f"{k}_ms": 1e3 * getattr(t, k)
                                                    for k in ("queue", "transfer", "decode", "compute", "encode")}}})
            if rec.done is not None:
                events.append({"name": "sample" if rec.error is None else "failed", "cat": "driver", "ph": "X",
                               "pid": 0, "tid": 0, "ts": 1e6 * (rec.done - t0), "dur": 1e6 * rec.sample,
                               "args": {**about, "tokens": rec.sampled, "error": rec.error}})
        for r in self.replans:  # one event per phase on the driver's lane, in order
            start = r.at - t0
            for phase in PHASES:
                seconds = r.seconds.get(phase, 0.0)
                events.append({"name": f"re-plan: {phase}", "cat": "replan", "ph": "X", "pid": 0, "tid": 1,
                               "ts": 1e6 * start, "dur": 1e6 * seconds, "args": r.describe()})
                start += seconds
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _mean_ms(values: list[float]) -> float:
    return 1e3 * statistics.fmean(values) if values else 0.0


def _colour(i: int) -> str:
    r, g, b = colorsys.hls_to_rgb((i * 0.618033988749895) % 1.0, 0.55, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def timeline_svg(run: RunTelemetry, width: int = 1100) -> str:
    """Per-stage lanes, one bar per step coloured by who it carried (a session, or a batch by its
    micro-batch slot, so that passes travelling together are told apart); the driver's lane shows
    sampling.  Hand-written SVG (no plotting dependency); each bar has a tooltip with its timings;
    the legend wraps and every label fits the canvas."""
    t0, t1 = run.window()
    span = max(t1 - t0, 1e-9)
    left, right, lane, gap, top, entry = 90, 20, 26, 8, 40, 140
    lanes = ["driver"] + [f"stage {k}" for k in range(run.num_stages)]
    keys = list(dict.fromkeys(_key(r) for r in run.steps.values()))
    keys.sort(key=lambda k: not str(k).startswith("micro-batch"))  # the legend names those first
    colour = {k: _colour(i) for i, k in enumerate(keys)}
    shown = keys[:24]
    per_row = max(1, (width - left - right) // entry)
    legend_rows = -(-len(shown) // per_row) + (len(keys) > len(shown))
    height = top + len(lanes) * (lane + gap) + 40 + 18 * legend_rows
    scale = (width - left - right) / span
    title = (f"Pipeline timeline: {run.num_stages} stage(s), {len(run.session_start)} session(s), "
             f"{run.micro_batches} micro-batch(es) in flight, {1e3 * span:.1f} ms (bars: busy)")
    width = max(width, int(left + text_width(title, 14) + 10))

    def x(t: float) -> float:
        return left + (t - t0) * scale

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{escape(title)}</text>']
    for i, name in enumerate(lanes):
        y = top + i * (lane + gap)
        out.append(f'<text x="8" y="{y + lane * 0.7:.1f}">{name}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{width - left - right}" height="{lane}" fill="#f2f2f2"/>')
    for rec in run.steps.values():
        fill = colour[_key(rec)]
        if rec.done is not None and rec.error is None:
            w = max(rec.sample * scale, 1.0)
            out.append(f'<rect x="{x(rec.done):.2f}" y="{top}" width="{w:.2f}" height="{lane}" '
                       f'fill="{fill}"><title>{escape(_who(rec))} step '
                       f'{rec.step}: sampling {1e3 * rec.sample:.3f} ms</title></rect>')
        for t in rec.stages:
            y = top + (t.stage + 1) * (lane + gap)
            w = max((t.end - t.start) * scale, 1.0)
            tip = (f"{_who(rec)} step {rec.step} ({rec.kind}, {rec.rows} rows) stage {t.stage}: "
                   f"queue {1e3 * t.queue:.3f} ms, transfer {1e3 * t.transfer:.3f} ms, decode "
                   f"{1e3 * t.decode:.3f} ms, compute {1e3 * t.compute:.3f} ms, encode {1e3 * t.encode:.3f} ms")
            out.append(f'<rect x="{x(t.start):.2f}" y="{y}" width="{w:.2f}" height="{lane}" '
                       f'fill="{fill}" stroke="white" stroke-width="0.5">'
                       f'<title>{escape(tip)}</title></rect>')
    for r in run.replans:  # a band over every lane while the pipeline was re-planned
        y1 = top + len(lanes) * (lane + gap) - gap
        w = max(sum(r.seconds.values()) * scale, 2.0)
        out.append(f'<rect x="{x(r.at):.2f}" y="{top}" width="{w:.2f}" height="{y1 - top}" fill="#d62728" '
                   f'fill-opacity="0.18" stroke="#d62728"><title>{escape(r.line())}</title></rect>')
        out.append(f'<text x="{x(r.at) + 3:.2f}" y="{top - 4}" fill="#d62728">'
                   f'{escape(f"re-plan: {len(r.old)} -> {len(r.new)} stages")}</text>')
    axis_y = top + len(lanes) * (lane + gap) + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{width - right}" y2="{axis_y}" stroke="black"/>')
    step_ms = _tick(1e3 * span)
    tick = 0.0
    while tick <= 1e3 * span + 1e-9:
        tx = left + tick / 1e3 * scale
        out.append(f'<line x1="{tx:.2f}" y1="{axis_y}" x2="{tx:.2f}" y2="{axis_y + 5}" stroke="black"/>')
        out.append(f'<text x="{tx:.2f}" y="{axis_y + 18}" text-anchor="middle">{tick:g} ms</text>')
        tick += step_ms
    for i, k in enumerate(shown):
        lx, ly = left + (i % per_row) * entry, axis_y + 28 + 18 * (i // per_row)
        out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{colour[k]}"/>')
        out.append(f'<text x="{lx + 16}" y="{ly + 10}">{escape(fit(_label(k), entry - 22, 12))}</text>')
    if len(keys) > len(shown):
        out.append(f'<text x="{left}" y="{axis_y + 38 + 18 * (legend_rows - 1)}">and {len(keys) - len(shown)} more</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _key(rec: StepRecord):
    """What a step's colour stands for: its session, or its micro-batch slot for a batch."""
    return rec.sessions[0] if len(rec.sessions) == 1 else f"micro-batch {rec.slot}"


def _who(rec: StepRecord) -> str:
    if len(rec.sessions) == 1:
        return f"session {rec.sessions[0]}"
    return f"batch of {len(rec.sessions)} sessions ({', '.join(map(str, rec.sessions[:8]))}{', ...' if len(rec.sessions) > 8 else ''})"


def _label(key) -> str:
    return key if isinstance(key, str) and key.startswith("micro-batch") else f"session {key}"


def _tick(span_ms: float) -> float:
    """A round tick spacing giving 5 to 10 ticks."""
    step = 10 ** int(f"{span_ms / 10:e}".split("e")[1]) if span_ms > 0 else 1.0
    for m in (1, 2, 5, 10):
        if span_ms / (step * m) <= 10:
            return step * m
    return step * 10
