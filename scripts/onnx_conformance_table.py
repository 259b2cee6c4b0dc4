"""Run the ONNX conformance suite and rewrite its table in docs/ops.md.

    .venv/bin/python scripts/onnx_conformance_table.py           # run, then rewrite the table
    .venv/bin/python scripts/onnx_conformance_table.py --check   # exit 1 if the table is stale

The table sits between ``<!-- BEGIN GENERATED: onnx-conformance -->`` and ``<!-- END GENERATED:
onnx-conformance -->`` in the "ONNX conformance" section; tests/test_onnx_conformance.py checks it
against the same run (tests/onnx_conformance.py).  A case that fails outside ``EXCLUDED`` is
printed and the table is not written: fix the converter or record the case first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import onnx_conformance as oc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/ops.md's table is stale")
    args = parser.parse_args(argv)
    results = oc.outcomes()
    failing = {name: o.reason for name, o in results.items() if o.status == "failed"}
    for name, reason in sorted(failing.items()):
        print(f"FAILING {name}: {reason}", file=sys.stderr)
    body = oc.render_table(results)
    if args.check:
        stale = oc.table_in_docs() != body
        if stale:
            print("docs/ops.md's ONNX conformance table is stale; run scripts/onnx_conformance_table.py",
                  file=sys.stderr)
        return int(stale or bool(failing))
    if failing:
        print(f"{len(failing)} failing case(s): table not written", file=sys.stderr)
        return 1
    changed = oc.write_table(body)
    print(body.splitlines()[-1])
    print("docs/ops.md updated" if changed else "docs/ops.md already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
