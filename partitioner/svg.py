"""A plan drawn as SVG, by hand: per stage, its memory against its budget and its compute.

Left: a stacked bar of weights / KV cache / activations / reserve, with the budget marked; all
stages share one byte scale.  Under the bar, each part's bytes; beside it, the total against the
budget; hovering a part (or the bar) gives exact bytes.  Right: the stage's time (compute /
speed) against the slowest stage, labelled with its share of the total compute.  No
dependencies: the markup is written out.
"""

from __future__ import annotations

from fractions import Fraction
from xml.sax.saxutils import escape

from dist_runtime.units import format_bytes

from .plan import Plan

COLORS = {"weights": "#4e79a7", "KV cache": "#f28e2b", "activations": "#59a14f", "reserve": "#bab0ac"}
# TIME_X leaves room for the widest total / budget beside a bar ("1023.9 MiB / 1023.9 MiB").
ROW, TOP, MEM_X, MEM_W, TIME_X, TIME_W = 50, 56, 200, 400, 750, 220
MIN_WIDTH = TIME_X + TIME_W + 50


def text_width(s: str, size: float, weight: str = "normal") -> float:
    """A generous estimate of a sans-serif string's width in pixels (no font metrics at hand):
    the canvas is sized from it so that no label is cut at the edge."""
    return len(s) * size * (0.66 if weight == "bold" else 0.6)


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 12, weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}">{escape(s)}</text>')


def fitted_svg(body: list[str], texts: list[tuple[float, str, float, str]], min_width: float, height: float,
               font: str = "sans-serif") -> list[str]:
    """The ``<svg>`` header and a white background, wide enough for every text of ``texts``
    ((x, string, size, weight), left-anchored), then ``body``."""
    width = int(max([min_width] + [x + text_width(s, size, weight) + 10 for x, s, size, weight in texts]))
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="{font}">',
            _rect(0, 0, width, height, "white"), *body]


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "", stroke: str = "none") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" fill="{fill}" '
            f'stroke="{stroke}">{tip}</rect>')


def plan_svg(plan: Plan) -> str:
    stages = plan.stages
    scale = max([s.memory.budget or 0 for s in stages] + [s.memory.total for s in stages] + [1])
    slowest = max([s.time for s in stages] + [1e-300])
    height = TOP + ROW * len(stages) + 70
    texts: list[tuple[float, str, float, str]] = []

    def text(x: float, y: float, s: str, size: int = 12, weight: str = "normal") -> str:
        texts.append((x, s, size, weight))
        return _text(x, y, s, size=size, weight=weight)

    out = [
        text(10, 20, f"Pipeline plan: {len(stages)} stages, {plan.model.get('nodes', '?')} nodes", size=15, weight="bold"),
        text(MEM_X, TOP - 10, "memory (weights / KV cache / activations / reserve) and budget", weight="bold"),
        text(TIME_X, TOP - 10, "time = compute / speed (share of compute)", weight="bold"),
    ]
    for i, s in enumerate(stages):
        y = TOP + i * ROW
        span = "empty" if s.empty else f"nodes {s.nodes[0]}..{s.nodes[-1]}"
        out.append(_text(10, y + 15, fit(f"stage {s.index} on {s.machine} (speed {s.speed})", MEM_X - 20, 12, "bold"),
                         weight="bold"))
        out.append(_text(10, y + 29, fit(span, MEM_X - 20, 11), size=11))
        out += _memory_bar(s.memory, y, scale, text)
        w = TIME_W * s.time / slowest
        color = "#e15759" if s.time == slowest else "#76b7b2"
        out.append(_rect(TIME_X, y + 4, w, 24, color, f"{s.compute:,} FLOPs / speed {s.speed} = {s.time:.4g}"))
        out.append(text(TIME_X + w + 4, y + 20, f"{s.share:.1%}", size=11))
    y = TOP + ROW * len(stages) + 18
    x = 10
    for name, color in COLORS.items():
        out += [_rect(x, y - 10, 12, 12, color), text(x + 16, y, name, size=11)]
        x += 110
    out.append(_rect(x, y - 10, 12, 12, "none", stroke="#b22222") + text(x + 16, y, "budget", size=11))
    ratio = float(Fraction(plan.bottleneck) / Fraction(plan.ideal)) if Fraction(plan.ideal) else 1.0
    out.append(text(10, y + 24, f"bottleneck / ideal = {ratio:.3f}; bytes across cuts "
                     f"{format_bytes(plan.cut_bytes)}; granularity {plan.request.get('granularity_used', '?')}; "
                     f"plan {plan.hash[:12]}", size=11))
    out.append("</svg>")
    return "\n".join(fitted_svg(out, texts, MIN_WIDTH, height)) + "\n"


def _parts(m) -> dict[str, int]:
    """A stage's memory estimate by part, in the order the bar stacks them."""
    return dict(zip(COLORS, (m.weights, m.kv, m.activations, m.reserve)))


def _against_budget(m) -> list[str]:
    """["2.4 MiB / 3.0 MiB", "80% of budget"], or ["2.4 MiB / no limit"]."""
    if m.budget is None:
        return [f"{format_bytes(m.total)} / no limit"]
    share = [f"{m.total / m.budget:.0%} of budget"] if m.budget > 0 else []
    return [f"{format_bytes(m.total)} / {format_bytes(m.budget)}", *share]


def _memory_bar(m, y: float, scale: int, text) -> list[str]:
    """One stage's memory: the stacked bar on the shared byte scale, its budget mark, the total
    against the budget beside it and each part's bytes under it (fitted before the time column)."""
    exact = "; ".join(f"{name} {value:,}" for name, value in _parts(m).items())
    budget = "no budget" if m.budget is None else f"budget {m.budget:,}"
    out = [_rect(MEM_X, y + 4, MEM_W, 24, "#f4f4f4",  # the shared byte scale
                 f"{', '.join(_against_budget(m))}: {exact} bytes; total {m.total:,} of {budget} bytes")]
    x = MEM_X
    for (name, value), color in zip(_parts(m).items(), COLORS.values()):
        w = MEM_W * value / scale
        out.append(_rect(x, y + 4, w, 24, color, f"{name}: {format_bytes(value)} ({value:,} bytes)"))
        x += w
    if m.budget is not None:
        bx = MEM_X + MEM_W * m.budget / scale
        out.append(f'<line x1="{bx:.1f}" y1="{y + 1}" x2="{bx:.1f}" y2="{y + 31}" stroke="#b22222" stroke-width="2"/>')
    lines = _against_budget(m)
    for k, line in enumerate(lines):  # beside the bar, before the time column
        out.append(text(MEM_X + MEM_W + 4, y + (20 if len(lines) == 1 else 15 + 12 * k),
                        fit(line, TIME_X - MEM_X - MEM_W - 10, 10), size=10))
    parts = " · ".join(f"{name} {format_bytes(value)}" for name, value in _parts(m).items())
    out.append(text(MEM_X, y + 42, fit(parts, TIME_X - MEM_X - 20, 10), size=10))
    return out


def fit(s: str, width: float, size: float, weight: str = "normal") -> str:
    """``s`` shortened with an ellipsis to fit ``width`` pixels (a label left of the bars)."""
    while len(s) > 4 and text_width(s, size, weight) > width:
        s = s[:-2] + "…"
    return s
