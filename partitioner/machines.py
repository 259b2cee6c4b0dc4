"""The machines a plan is made for: a memory budget, a reserve kept free, a relative speed.

Machines are taken in the order given: stage ``k`` runs on machine ``k`` (the pipeline order is
the user's, e.g. the order of hosts on the network path).  Speeds are relative (``2`` means twice
as fast as ``1``) and are held as exact fractions so that the solver compares stage times without
rounding; a float speed is snapped to the nearest fraction with denominator at most 10 000.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from dist_runtime.errors import DistRuntimeError
from dist_runtime.units import format_bytes, parse_bytes

#: Where stage boundaries may fall (``--granularity``): see ``granularity.py``.
GRANULARITIES = ("auto", "layer", "node")

#: Denominator bound for speeds given as floats (1/3 -> 3333/10000 would be wrong; 1/3 is kept).
MAX_SPEED_DENOMINATOR = 10_000


def as_speed(value: object) -> Fraction:
    """``2``, ``1.5``, ``"3/2"`` or a Fraction -> a positive Fraction."""
    try:
        speed = Fraction(str(value)) if isinstance(value, str) else Fraction(value)
    except (ValueError, TypeError, ZeroDivisionError):
        raise DistRuntimeError(f"speed {value!r} is not a number; write e.g. 1, 2, 1.5 or 3/2") from None
    speed = speed.limit_denominator(MAX_SPEED_DENOMINATOR)
    if speed <= 0:
        raise DistRuntimeError(f"speed {value!r} must be positive")
    return speed


@dataclass(frozen=True)
class Machine:
    """One pipeline slot.  ``budget=None`` means no memory limit (``--stages N`` alone)."""

    budget: int | None = None
    speed: Fraction = Fraction(1)
    reserve: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speed", as_speed(self.speed))
        if self.budget is not None and self.budget < 0 or self.reserve < 0:
            raise DistRuntimeError(f"machine {self.name!r}: budget and reserve must not be negative")
        if self.budget is not None and self.reserve > self.budget:
            raise DistRuntimeError(
                f"machine {self.name!r}: the reserve {format_bytes(self.reserve)} exceeds the budget "
                f"{format_bytes(self.budget)}; nothing would fit"
            )

    @property
    def capacity(self) -> int | None:
        """Bytes available to a stage: the budget minus the reserve (None: unlimited)."""
        return None if self.budget is None else self.budget - self.reserve

    def describe(self, index: int | None = None) -> str:
        """``m2 (16.0 GiB minus reserve 1.0 GiB)``; unnamed machines go by their index."""
        name = self.name or (f"#{index}" if index is not None else "(unnamed)")
        if self.budget is None:
            return f"{name} (no memory limit)"
        reserve = f" minus reserve {format_bytes(self.reserve)}" if self.reserve else ""
        return f"{name} ({format_bytes(self.budget)}{reserve})"


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def make_machines(
    stages: int | None = None,
    budgets: Sequence[int | str] | str | None = None,
    speeds: Sequence[object] | str | None = None,
    reserve: int | str = 0,
) -> list[Machine]:
    """Machines from the CLI's vocabulary.

    ``stages`` alone: that many unlimited machines of speed 1.  ``budgets``: one machine per
    budget (``"8GiB,16GiB"`` or a list); with ``stages`` too, a single budget is repeated.
    ``speeds``: one per machine, or a single value for all.  ``reserve``: kept free on each.
    """
    if isinstance(budgets, str):
        budgets = _split(budgets)
    if isinstance(speeds, str):
        speeds = _split(speeds)
    sizes = [b if isinstance(b, int) else _size(b) for b in budgets or []]
    reserve = reserve if isinstance(reserve, int) else _size(reserve)
    count = stages if stages is not None else len(sizes)
    if count is None or count <= 0:
        raise DistRuntimeError("give a number of stages (--stages N) or a list of budgets (--budgets 8GiB,16GiB)")
    if sizes and len(sizes) not in (1, count):
        raise DistRuntimeError(f"{len(sizes)} budgets were given for {count} stages; give 1 or {count}")
    if sizes and len(sizes) == 1:
        sizes = sizes * count
    speeds = list(speeds or [1])
    if len(speeds) not in (1, count):
        raise DistRuntimeError(f"{len(speeds)} speeds were given for {count} machines; give 1 or {count}")
    if len(speeds) == 1:
        speeds = speeds * count
    return [
        Machine(budget=sizes[k] if sizes else None, speed=as_speed(speeds[k]),
                reserve=reserve if sizes else 0, name=f"m{k}")
        for k in range(count)
    ]


def _size(text: str) -> int:
    try:
        return parse_bytes(str(text))
    except ValueError as e:
        raise DistRuntimeError(str(e)) from None
