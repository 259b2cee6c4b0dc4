"""The plan's picture shows each stage's memory estimate: the bytes of its weights, KV cache,
activations and reserve as text under its bar and exactly in the parts' tooltips, and the total
against the stage's budget -- all within the canvas."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from conftest import save_example

from dist_runtime.examples import LlamaConfig
from dist_runtime.model import load_model
from dist_runtime.partitioner.machines import make_machines
from dist_runtime.partitioner.planner import partition
from dist_runtime.partitioner.svg import ROW, TIME_X, TOP, plan_svg, text_width
from dist_runtime.units import format_bytes

SVG = "{http://www.w3.org/2000/svg}"


def _plan(tmp_path, budgets: str | None = "1MiB,2MiB", reserve: str = "64KiB"):
    path = save_example(tmp_path / "tiny.model", LlamaConfig(layers=2))
    with load_model(path, tensors=[]) as model:
        machines = make_machines(None if budgets else 2, budgets, "1,2", reserve)
        return partition(model.graph, machines, max_context=32, sessions=2, tokens=4)


def _texts(root) -> list[str]:
    return [t.text or "" for t in root.iter(SVG + "text")]


def test_each_stage_shows_its_memory_parts_against_its_budget(tmp_path):
    plan = _plan(tmp_path)
    root = ET.fromstring(plan_svg(plan))
    texts = _texts(root)
    titles = [t.text for t in root.iter(SVG + "title")]
    for s in plan.stages:
        m = s.memory
        assert m.weights > 0 and m.kv > 0 and m.activations > 0
        parts = (f"weights {format_bytes(m.weights)} · KV cache {format_bytes(m.kv)} · activations "
                 f"{format_bytes(m.activations)} · reserve {format_bytes(m.reserve)}")
        assert parts in texts  # readable without hovering
        assert f"{format_bytes(m.total)} / {format_bytes(m.budget)}" in texts
        assert f"{m.total / m.budget:.0%} of budget" in texts
        for name, value in (("weights", m.weights), ("KV cache", m.kv), ("activations", m.activations)):
            assert f"{name}: {format_bytes(value)} ({value:,} bytes)" in titles
        assert any(f"total {m.total:,} of budget {m.budget:,} bytes" in t for t in titles)  # the whole bar


def test_the_parts_fit_before_the_time_column_and_the_canvas(tmp_path):
    plan = _plan(tmp_path)
    root = ET.fromstring(plan_svg(plan))
    width = float(root.get("width"))
    for t in root.iter(SVG + "text"):
        x, size = float(t.get("x")), float(t.get("font-size"))
        assert x + text_width(t.text or "", size, t.get("font-weight")) <= width
        if x < TIME_X:  # a stage's memory figures stay left of the time bars
            assert x + text_width(t.text or "", size, t.get("font-weight")) < TIME_X or float(t.get("y")) < TOP \
                or float(t.get("y")) > TOP + ROW * len(plan.stages), t.text


def test_a_stage_without_budget_says_so(tmp_path):
    plan = _plan(tmp_path, budgets=None, reserve="0")
    root = ET.fromstring(plan_svg(plan))
    texts = _texts(root)
    assert all(s.memory.budget is None for s in plan.stages)
    assert sum(t.endswith("/ no limit") for t in texts) == len(plan.stages)
    assert not root.findall(f".//{SVG}line")  # no budget mark
