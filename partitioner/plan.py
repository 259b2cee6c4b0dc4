"""The plan the Ray runtime consumes: one entry per stage, JSON-serialisable, with a stable hash.

A stage names its machine, the positions ``[start, stop)`` it covers in ``order`` (the execution
order the plan was cut from, as node ids), its node ids, the weights it must map, the tensors it
receives and sends, its memory broken into weights / KV / activations / reserve against the
machine's budget, and its compute.  ``Plan.hash`` is a SHA-256 of the canonical JSON without the
solver's timings, so the same request on the same graph gives the same hash on every run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from fractions import Fraction

from dist_runtime.errors import DistRuntimeError
from dist_runtime.units import format_bytes

FORMAT = "dist-runtime-plan/1"


@dataclass(frozen=True)
class StageMemory:
    weights: int
    kv: int
    activations: int
    reserve: int
    budget: int | None  # None: no limit

    @property
    def total(self) -> int:
        """What the stage needs, reserve included; at most ``budget``."""
        return self.weights + self.kv + self.activations + self.reserve


@dataclass(frozen=True)
class Stage:
    index: int
    machine: str
    speed: str  # exact, e.g. "3/2"
    start: int  # positions in Plan.order: this stage runs order[start:stop]
    stop: int
    nodes: tuple[int, ...]  # node ids, in execution order
    weights: tuple[str, ...]  # weight names to map, each once
    memory: StageMemory
    compute: int  # FLOPs
    time: float  # compute / speed
    share: float  # of the total compute
    bytes_in: int
    bytes_out: int
    tensors_in: tuple[str, ...]  # received from the previous stage (graph inputs for stage 0)
    tensors_out: tuple[str, ...]  # sent to the next stage (graph outputs for the last)

    @property
    def empty(self) -> bool:
        return self.start == self.stop


@dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    order: tuple[int, ...]  # node ids in execution order
    request: dict  # max_context, sessions, microbatches, tokens, granularity, allow_empty
    bottleneck: str  # exact, "num/den" FLOPs per unit speed
    ideal: str  # total compute / total speed, exact
    cut_bytes: int
    total_compute: int
    model: dict = field(default_factory=dict)
    solver: dict = field(default_factory=dict, compare=False)  # timings: not part of the hash

    @property
    def ratio(self) -> float:
        """Bottleneck over ideal: 1.00 is a perfect balance."""
        ideal = Fraction(self.ideal)
        return float(Fraction(self.bottleneck) / ideal) if ideal else 1.0

    def to_dict(self, *, timings: bool = True) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stages"}
        d["stages"] = [{f.name: getattr(s, f.name) for f in fields(s)} | {"memory": asdict(s.memory)}
                       for s in self.stages]  # shallow: the tuples of ids and names serialise as is
        if not timings:
            d.pop("solver")
        d["format"] = FORMAT
        return d

    @cached_property
    def hash(self) -> str:
        canonical = json.dumps(self.to_dict(timings=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict() | {"hash": self.hash}, indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} plan (format {d.get('format')!r})")
        stages = tuple(
            Stage(**{**s, "nodes": tuple(s["nodes"]), "weights": tuple(s["weights"]),
                     "tensors_in": tuple(s["tensors_in"]), "tensors_out": tuple(s["tensors_out"]),
                     "memory": StageMemory(**s["memory"])})
            for s in d["stages"]
        )
        keys = {"request", "bottleneck", "ideal", "cut_bytes", "total_compute", "model", "solver"}
        plan = cls(stages=stages, order=tuple(d["order"]), **{k: d[k] for k in keys if k in d})
        if "hash" in d and d["hash"] != plan.hash:
            raise ValueError("the plan's hash does not match its content")
        return plan

    @classmethod
    def from_json(cls, text: str, where: str = "the plan") -> Plan:
        """A plan written by ``to_json`` (``partition -o``); anything else is a ``DistRuntimeError``
        naming ``where`` and what is wrong."""
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise DistRuntimeError(f"{where} is not JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                                   f"write one with `dist-runtime partition MODEL -o PLAN.json`") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DistRuntimeError(f"{where} is not a plan written by `dist-runtime partition -o` "
                                   f"({type(e).__name__}: {e})") from None

    # -- text --------------------------------------------------------------------------------
    def table(self) -> str:
        """The per-stage table and the footer the CLI prints."""
        head = ("stage", "machine", "speed", "nodes", "weights", "KV", "activ.", "reserve",
                "total / budget", "compute", "time", "in", "out")
        rows = [head]
        for s in self.stages:
            m = s.memory
            budget = "unlimited" if m.budget is None else format_bytes(m.budget)
            span = "(empty)" if s.empty else f"{s.nodes[0]}..{s.nodes[-1]} ({len(s.nodes)})"
            rows.append((
                str(s.index), s.machine, s.speed, span, format_bytes(m.weights), format_bytes(m.kv),
                format_bytes(m.activations), format_bytes(m.reserve),
                f"{format_bytes(m.total)} / {budget}", f"{s.share:.1%}", f"{s.time:.3g}",
                format_bytes(s.bytes_in), format_bytes(s.bytes_out),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + [self.footer()])

    def footer(self) -> str:
        slowest = max(self.stages, key=lambda s: (s.time, -s.index))
        seconds = self.solver.get("seconds")
        timing = "" if seconds is None else f"; solver {seconds * 1000:.0f} ms"
        total = self.solver.get("total_seconds")
        timing += "" if total is None else f" (plan {total * 1000:.0f} ms)"
        return (
            f"bottleneck / ideal = {float(Fraction(self.bottleneck)):.4g} / "
            f"{float(Fraction(self.ideal)):.4g} = {self.ratio:.3f} (stage {slowest.index}); "
            f"bytes across cuts {format_bytes(self.cut_bytes)} ({self.cut_bytes:,}); "
            f"granularity {self.request.get('granularity_used', '?')}{timing}; hash {self.hash[:12]}"
        )
