"""What travels with a step's tensors through every stage, and what a stage records of a step.

The header is the message's meta map (``transport.encode_message``): the session, the position of
the step's first row, the step's number and three flags.  Stages echo it in their reply, so the
last stage's reply names the step it answers.  Read from the wire, every field is checked before it
is used: a bad one is a ``TransportError`` that fails that message only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import TransportError


class BatchSegment(NamedTuple):
    """One session's rows in a batched step: ``rows`` rows at ``pos``; ``reset`` its first;
    ``ceiling`` the KV rows its request may reach (``GraphExecutor.set_kv_ceiling``; 0: none)."""

    session: int | str
    pos: int
    rows: int
    reset: bool = False
    ceiling: int = 0


#: Segments one batched step may carry (the stages' session limit bounds it further).
MAX_SEGMENTS = 4096


#: What a step asks of the last stage's logits (:attr:`StepHeader.logits`).
LOGITS = ("last", "all", "argmax")


@dataclass(frozen=True)
class StepHeader:
    session: int | str
    pos: int  # the position of the step's first row in the session
    step: int  # the coordinator's step number (telemetry joins records on it)
    reset: bool = False  # clear the session's KV caches first (its first step, or a replay)
    close: bool = False  # forget the session after this pass (a one-off pass of a stateless graph)
    # What the last stage returns of the logits (LOGITS): "last", each segment's last row (the
    # driver samples from it); "all", every row; "argmax", each segment's greedy token (the argmax
    # of its last row, int32): 4 bytes a session instead of the vocabulary's 4 a token (128 KB at 32k)
    logits: str = "last"
    # A batched step (continuous batching): the sessions whose rows the tensors hold, in order;
    # ``session``/``pos`` are then its first segment's.  Empty for a step of one session.
    batch: tuple[BatchSegment, ...] = ()
    ceiling: int = 0  # the KV rows the session's request may reach (a step of one session; 0: none)

    def to_meta(self) -> dict:
        meta = {"session": self.session, "pos": self.pos, "step": self.step}
        meta.update({k: True for k in ("reset", "close") if getattr(self, k)})
        if self.ceiling:
            meta["ceiling"] = self.ceiling
        if self.logits != "last":
            meta["logits"] = self.logits
        if self.batch:
            meta["batch"] = [list(seg) for seg in self.batch]
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> StepHeader:
        logits = meta.get("logits", "last")
        if logits not in LOGITS:
            raise TransportError(f"meta 'logits' must be one of {', '.join(map(repr, LOGITS))}, got {logits!r}")
        return cls(_session(meta.get("session"), "'session'"), _count(meta, "pos"), _count(meta, "step"), _flag(meta, "reset"), _flag(meta, "close"),
                   logits, _batch(meta.get("batch", [])), _count(meta, "ceiling", 0))


def _batch(items) -> tuple[BatchSegment, ...]:
    if not isinstance(items, list) or len(items) > MAX_SEGMENTS:
        raise TransportError(f"meta 'batch' must be a list of at most {MAX_SEGMENTS} segments")
    segments = []
    for i, item in enumerate(items):
        if not isinstance(item, list) or len(item) not in (4, 5):
            raise TransportError(f"meta 'batch'[{i}] must be [session, pos, rows, reset, ceiling], got {item!r}")
        fields = dict(zip(("session", "pos", "rows", "reset", "ceiling"), item))
        seg = BatchSegment(_session(fields["session"], f"'batch'[{i}] session"), _count(fields, "pos"), _count(fields, "rows"),
                           _flag(fields, "reset"), _count(fields, "ceiling", 0))
        if seg.rows < 1:
            raise TransportError(f"meta 'batch'[{i}] has no rows")
        segments.append(seg)
    if len({seg.session for seg in segments}) != len(segments):
        raise TransportError("meta 'batch' names a session twice")
    return tuple(segments)


def _session(value, what: str) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TransportError(f"meta {what} must be an int or a string, got {type(value).__name__}")
    return value


def _count(meta: dict, key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TransportError(f"meta {key!r} must be a non-negative integer, got {value!r}")
    return value


def _flag(meta: dict, key: str) -> bool:
    value = meta.get(key, False)
    if not isinstance(value, bool):
        raise TransportError(f"meta {key!r} must be true or false, got {value!r}")
    return value


#: Step records a run keeps, the oldest dropped first, on the driver and on each stage (between two
#: collections): a server's endless stream stays within a few MiB per process (~700 bytes a step on
#: the driver, ~300 on a stage), and its figures describe the last RECORDS_KEPT steps.
RECORDS_KEPT = 32_768


class StageRecord(NamedTuple):
    """One step as a stage saw it: wall-clock start and end (to line stages up on one timeline),
    the seconds spent decoding, computing and encoding, and when the stage's previous call ended
    (queue wait is measured from it)."""

    step: int
    session: int | str
    start: float
    end: float
    decode: float
    compute: float
    encode: float
    previous_end: float
