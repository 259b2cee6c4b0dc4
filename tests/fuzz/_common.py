"""What the atheris entry points share: the import paths, the instrumented import of the code
under test, the seeds as the starting corpus."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for p in (TESTS.parent, TESTS, TESTS / "fuzz"):  # the package, conftest, the oracle
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import atheris  # noqa: E402

# Instrument the code under test for coverage feedback: it must be imported here first, under
# instrument_imports (a module imported earlier is not instrumented).
with atheris.instrument_imports(include=["dist_runtime", "oracle"]):
    import oracle  # noqa: F401  (imports dist_runtime's readers)


def run(target: str, test_one, argv: list[str], seeds: list[bytes] | None = None) -> None:
    """Start atheris on ``test_one(data: bytes)``; with no corpus directory on the command line,
    a temporary one holds the target's seeds (valid inputs built from the example models)."""
    seeds = oracle.seeds()[target] if seeds is None else seeds
    if not any(not a.startswith("-") for a in argv[1:]):
        import tempfile

        corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-"))
        for i, s in enumerate(seeds):
            (corpus / f"seed{i}").write_bytes(s)
        argv = [*argv, str(corpus)]
    atheris.Setup(argv, test_one)
    atheris.Fuzz()
