"""The compiled kernels' on-disk cache follows every source compiled into it (compiled/freshness.py).

numba keys a cached function by its own file: a helper inlined from another file can change and
the caller's cached code keep the old helper.  The package clears such code when any of its
sources changes; tested on a small package of the same shape, in child processes (the cache is
what one process leaves the next)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dist_runtime.backends.compiled import freshness

HELPER = """import numba

@numba.njit(cache=True, inline="always")
def helper():
    return {value}
"""

CALLER = """import numba
from .helper import helper

@numba.njit(cache=True)
def caller():
    return helper()
"""


def _package(root: Path, value: int) -> list[Path]:
    pkg = root / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text(HELPER.format(value=value))
    (pkg / "caller.py").write_text(CALLER)
    return [pkg / "helper.py", pkg / "caller.py"]


def _run(root: Path, refresh: bool) -> int:
    """``pkg.caller.caller()`` in a fresh process, after :func:`freshness.refresh` or not."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from dist_runtime.backends.compiled.freshness import refresh
        pkg = Path({str(root / "pkg")!r})
        if {refresh}:
            refresh([pkg / "helper.py", pkg / "caller.py"], pkg / "__pycache__" / "sources.sha256")
        import pkg.caller
        print(pkg.caller.caller())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.slow  # compiles in two child processes
def test_a_change_to_an_inlined_helper_alone_reaches_its_callers(tmp_path):
    """Without the refresh, numba 0.68 answers 1 the second time too, from the caller's cache."""
    sources = _package(tmp_path, 1)
    assert _run(tmp_path, refresh=True) == 1  # compiled and cached
    assert any((tmp_path / "pkg" / "__pycache__").glob("caller.*.nbi"))
    _package(tmp_path, 2)  # the helper's file alone changes
    assert _run(tmp_path, refresh=True) == 2
    assert freshness.refresh(sources, tmp_path / "pkg" / "__pycache__" / "sources.sha256") is False  # up to date


def test_refresh_deletes_only_the_listed_sources_cache(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__" / "portable").mkdir(parents=True)
    kept = [pkg / "__pycache__" / "other.f-1.py311.nbi", pkg / "__pycache__" / "caller.txt"]
    gone = [pkg / "__pycache__" / "caller.f-3.py311.nbi", pkg / "__pycache__" / "portable" / "caller.f-3.py311.1.nbc"]
    for f in kept + gone:
        f.write_text("x")
    (pkg / "caller.py").write_text("x = 1\n")
    stamp = pkg / "__pycache__" / "sources.sha256"
    assert freshness.refresh([pkg / "caller.py"], stamp) is True
    assert all(f.exists() for f in kept) and not any(f.exists() for f in gone)
    assert stamp.read_text() == freshness.digest([pkg / "caller.py"])
    gone[0].write_text("x")
    assert freshness.refresh([pkg / "caller.py"], stamp) is False and gone[0].exists()  # unchanged: kept


def test_refresh_changes_nothing_where_it_cannot_read(tmp_path):
    assert freshness.refresh([tmp_path / "missing.py"], tmp_path / "stamp") is False
    assert not (tmp_path / "stamp").exists()


def test_the_package_lists_every_source_with_cached_code():
    """Every file under backends/ whose functions numba caches (``cache=True``, or the numba
    backend's ``_jit``) is among the sources the refresh follows."""
    backends = freshness.PACKAGE.parent
    cached = {p for p in backends.rglob("*.py") if "cache=True" in p.read_text() or "\n_jit = " in p.read_text()}
    assert {backends / "compiled" / "rows.py", backends / "program" / "vm.py"} <= cached
    assert cached <= set(freshness.SOURCES), cached - set(freshness.SOURCES)
