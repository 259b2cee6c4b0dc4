"""Where the compiled kernels are cached (compiled/cache.py): by the sources' contents and the CPU
path, not by where the sources lie -- so a copy elsewhere (a Ray job's working directory) loads
what another copy compiled, and a change to any source compiled in names a new directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dist_runtime.backends.compiled import cache, cpu, launch, rows
from dist_runtime.backends.program import vm


def test_every_kernel_is_cached_under_the_version_directory():
    for fn in (rows.rms_rows, vm._work, launch._launch):
        path = Path(fn._cache._cache_path)
        assert path.parent == cache.DIRECTORY / "backends" or path.parent.parent == cache.DIRECTORY, path
    assert cache.DIRECTORY.name == f"{cache.digest(cache.SOURCES)[:16]}-{cpu.PATH}"


def test_the_version_follows_every_file_that_defines_or_inlines_a_kernel():
    """Every module of the package that defines a cached kernel (``jit(``) is among the sources
    the directory is named by; so are the intrinsics' modules, whose code the kernels inline."""
    package = cache.PACKAGE
    defining = {p for p in package.rglob("*.py") if "jit(nogil" in p.read_text()}
    assert {package / "backends" / "compiled" / "rows.py", package / "backends" / "program" / "vm.py"} <= defining
    assert defining | {package / "backends" / "compiled" / f"{m}.py" for m in ("simd", "simd_k", "simd_int8")} \
        <= set(cache.SOURCES)


def test_the_digest_is_of_the_set_of_sources():
    a = cache.digest(cache.SOURCES)
    assert a == cache.digest(list(reversed(cache.SOURCES))) != cache.digest(cache.SOURCES[1:])


def test_prune_removes_only_other_versions_unused_for_a_month(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DIRECTORY", tmp_path / "current")
    old, recent, foreign = tmp_path / "old-avx2", tmp_path / "recent-avx2", tmp_path / "not-ours"
    for d in (old, recent):
        d.mkdir()
        (d / cache._USED).touch()
    foreign.mkdir()  # no mark: not a version directory, never removed
    month = cache.KEEP_DAYS * 86400
    os.utime(old / cache._USED, (time.time() - month - 60,) * 2)
    os.utime(recent / cache._USED, (time.time() - month + 3600,) * 2)
    assert cache.prune() == [old]
    assert recent.exists() and foreign.exists() and (tmp_path / "current" / cache._USED).exists()


def test_the_root_is_chosen_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DIST_RUNTIME_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "b"))
    assert cache.root() == tmp_path / "a"
    monkeypatch.delenv("DIST_RUNTIME_CACHE")
    assert cache.root() == tmp_path / "b"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert cache.root() == tmp_path / "c" / "dist-runtime"


PROBE = textwrap.dedent("""
    import numpy as np
    from dist_runtime.backends.compiled import cache, rows
    x = np.ones((2, 8), np.float32); w = np.ones(8, np.float32); out = np.empty_like(x)
    rows.rms_rows(x, w, 1e-5, out)
    print(cache.DIRECTORY.name, rows.rms_rows.stats.cache_hits.most_common(1)[0][1]
          if rows.rms_rows.stats.cache_hits else 0, float(out[0, 0]))
""")


def _probe(package_parent: Path, cache_root: Path, **env) -> list[str]:
    environment = {**os.environ, "DIST_RUNTIME_CACHE": str(cache_root), "PYTHONPATH": str(package_parent), **env}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=package_parent, env=environment, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.slow  # compiles in a child process
def test_a_copy_of_the_sources_elsewhere_loads_what_another_compiled(tmp_path):
    """As two Ray jobs whose working directories unpack the same project to different paths."""
    copies = []
    for name in ("job-a", "job-b"):
        shutil.copytree(cache.PACKAGE, tmp_path / name / "dist_runtime", ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(tmp_path / name)
    first = _probe(copies[0], tmp_path / "cache")
    second = _probe(copies[1], tmp_path / "cache")
    assert first[0] == second[0] == cache.DIRECTORY.name
    assert (first[1], second[1]) == ("0", "1")  # compiled by the first, loaded by the second
    portable = _probe(copies[1], tmp_path / "cache", DIST_RUNTIME_PORTABLE="1")
    assert portable[0].endswith("-portable") and portable[1] == "0"  # never the vector path's code
    assert first[2] == second[2] == portable[2]
