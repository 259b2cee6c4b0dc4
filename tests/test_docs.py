"""docs/ stays true to the op table: generated tables are fresh, and every op's hand-written
section in docs/ops.md lists exactly its payload fields, wire types and defaults."""

import dataclasses
import re
from pathlib import Path

import pytest

from dist_runtime.ir import docgen
from dist_runtime.ir.ops import OPS_BY_NAME

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_generated_tables_are_fresh():
    assert docgen.main(["--check"]) == 0, "run: python -m dist_runtime.ir.docgen"


def _section(text: str, name: str, tag: int) -> str:
    start = text.index(f"### {name} (tag {tag})")
    end = text.find("\n### ", start + 1)
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.parametrize("name", sorted(OPS_BY_NAME))
def test_ops_md_payload_table_matches_the_op_table(name):
    spec = OPS_BY_NAME[name]
    section = _section((DOCS / "ops.md").read_text(), name, spec.tag)
    rows = re.findall(r"^\| `(\w+)` \| ([\w\[\]]+) \| ([^|]+) \|", section, re.M)
    assert [(field, wire) for field, wire, _ in rows] == [(f.name, f.wire.name) for f in spec.fields]
    for (field, _, default), f in zip(rows, spec.fields):
        required = f.default is dataclasses.MISSING
        assert (default.strip() == "required") == required, (name, field, default)


def test_every_doc_names_only_existing_files():
    for doc in ("format.md", "ops.md", "architecture.md"):
        for path in re.findall(r"`((?:dist_runtime|kernels|partitioner|tests)/[\w/.]+\.py)`", (DOCS / doc).read_text()):
            assert (DOCS.parent / path).exists(), f"docs/{doc} names {path}, which does not exist"
