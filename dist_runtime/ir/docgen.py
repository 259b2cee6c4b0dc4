"""Generate the parts of docs/ that restate the op table, so they cannot drift from it.

``python -m dist_runtime.ir.docgen`` rewrites the text between ``<!-- BEGIN GENERATED: NAME -->``
and ``<!-- END GENERATED: NAME -->`` in docs/ops.md (``op-table``) and docs/format.md
(``op-payloads``); ``--check`` exits non-zero if either is stale (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from .payload import OPS_BY_TAG, OpSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _arity(spec: OpSpec) -> str:
    lo, hi = spec.inputs
    return str(lo) if lo == hi else (f"{lo}+" if hi >= 2**31 else f"{lo}–{hi}")


def _default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "name"):
        return value.name.lower()
    return repr(value) if not isinstance(value, tuple) else str(list(value))


def _field(f, with_default: bool) -> str:
    text = f"`{f.wire.name} {f.name}`"
    if with_default and f.default is not dataclasses.MISSING:
        text += f" = {_default(f.default)}"
    return text


def _payload(spec: OpSpec, with_default: bool) -> str:
    return ", ".join(_field(f, with_default) for f in spec.fields) or "(empty)"


def op_table() -> str:
    rows = ["| tag | op | inputs | outputs | payload (defaults) | rows | summary |", "|---|---|---|---|---|---|---|"]
    for tag, spec in sorted(OPS_BY_TAG.items()):
        outs = spec.outputs
        if not isinstance(outs, int):  # a payload field gives the count: a list's length, or a number
            listy = next(f for f in spec.fields if f.name == outs).wire.fmt is None
            outs = f"len({outs})" if listy else outs
        rows.append(
            f"| {tag} | [{spec.name}](#{spec.name.lower()}-tag-{tag}) | {_arity(spec)} | {outs} | "
            f"{_payload(spec, True)} | {spec.rows} | {spec.doc.replace('|', '/')} |"
        )
    return "\n".join(rows)


def op_payloads() -> str:
    rows = ["| tag | op | op_payload, in order |", "|---|---|---|"]
    for tag, spec in sorted(OPS_BY_TAG.items()):
        rows.append(f"| {tag} | {spec.name} | {_payload(spec, False)} |")
    return "\n".join(rows)


SECTIONS = {"ops.md": ("op-table", op_table), "format.md": ("op-payloads", op_payloads)}


def render(text: str, name: str, body: str) -> str:
    pattern = re.compile(
        rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S
    )
    if not pattern.search(text):
        raise SystemExit(f"marker for generated section {name!r} not found")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/ are stale")
    args = parser.parse_args(argv)
    stale = []
    for filename, (name, make) in SECTIONS.items():
        path = DOCS / filename
        old = path.read_text(encoding="utf-8")
        new = render(old, name, make())
        if new != old:
            stale.append(filename)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale generated sections in docs/{', docs/'.join(stale)}; run "
              "`python -m dist_runtime.ir.docgen`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
