"""Where the compiled kernels are cached: one directory per user and machine, named by the
contents of the sources and the CPU path, not by where the sources lie.

numba's own cache sits beside each source file (``__pycache__``) or under a directory named
after the source's absolute path.  Neither fits how the runtime is deployed: a Ray job's
``--working-dir`` unpacks the project to a new path for every upload, so every job would compile
afresh, and the stage actors of one node would each compile the same kernels.  Here every
kernel of this package (:func:`jit`, used in place of ``numba.njit(cache=True)``) is cached under

    ROOT / "<digest of the sources>-<CPU path>" / <the module's directory within the package>

where ROOT is ``$DIST_RUNTIME_CACHE``, else ``$NUMBA_CACHE_DIR``, else
``$XDG_CACHE_HOME/dist-runtime`` (``~/.cache/dist-runtime``).  So:

- any copy of the same sources, wherever it lies, finds the same cached code: every stage actor
  of a node and every job that ships the same project;
- a change to any source compiled into the kernels (an edit, a ``git pull``) names a new
  directory: numba keys a cached function by its own file alone, so code inlined from another
  file would otherwise be loaded stale, with no error;
- the portable path (``DIST_RUNTIME_PORTABLE=1``) and the vector path never share code: the
  same functions compile to other bits on each;
- numba's index in each file still keys entries by argument types and the CPU's name and
  features, so a ROOT shared by several machines (a network home) holds each one's code.

Directories of other source digests not used for :data:`KEEP_DAYS` days are removed by
:func:`prune` (from :func:`.init`).  Where ROOT cannot be written, numba's own locations serve.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numba
from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator

from . import cpu

#: The package whose modules' kernels are cached here (``dist_runtime``).
PACKAGE = Path(__file__).resolve().parents[2]
#: The sources compiled into cached code: every module that defines a kernel, and those whose
#: intrinsics or constants are compiled into them (:mod:`.simd`, :mod:`.simd_k`, :mod:`.registry`,
#: the attention's pieces).
SOURCES = (sorted(Path(__file__).resolve().parent.glob("*.py")) + sorted((PACKAGE / "backends" / "program").glob("*.py"))
           + [PACKAGE / "attention_pieces.py"])
#: Days a directory of other sources may go unused before :func:`prune` removes it.
KEEP_DAYS = 30
_USED = ".last-used"


def digest(sources: list[Path]) -> str:
    """One SHA-256 over the sources' paths within the package and their contents."""
    h = hashlib.sha256()
    for path in sorted(sources, key=lambda p: p.relative_to(PACKAGE).as_posix()):
        h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def root() -> Path:
    """The directory that holds every version's cache (see the module's docstring)."""
    for variable in ("DIST_RUNTIME_CACHE", "NUMBA_CACHE_DIR"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dist-runtime"


#: This process's cache directory: these sources on this CPU path.
VERSION = f"{digest(SOURCES)[:16]}-{cpu.PATH}"
DIRECTORY = root() / VERSION


class _Locator(_CacheLocator):
    """numba's locator for this package's kernels: :data:`DIRECTORY`, then the module's
    directory within the package; the stamp is the version, which the directory's name holds."""

    def __init__(self, py_func, py_file: str) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._path = DIRECTORY / Path(py_file).resolve().parent.relative_to(PACKAGE)

    def get_cache_path(self) -> str:
        return str(self._path)

    def get_source_stamp(self) -> str:
        return VERSION

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file: str):
        try:
            locator = cls(py_func, py_file)
            locator.ensure_cache_path()
        except (OSError, ValueError):  # ROOT not writable, or a file outside the package
            return None
        return locator


class _Impl(CompileResultCacheImpl):
    _locator_classes = [_Locator, *CompileResultCacheImpl._locator_classes]


class _Cache(FunctionCache):
    _impl_class = _Impl


def jit(**options):
    """``numba.njit(**options)``, cached in :data:`DIRECTORY` (the module's docstring)."""
    def decorate(fn):
        dispatcher = numba.njit(**options)(fn)
        dispatcher._cache = _Cache(fn)  # as numba's enable_caching(), with this package's locator
        return dispatcher
    return decorate


def prune(now: float | None = None) -> list[Path]:
    """Mark :data:`DIRECTORY` used, and remove ROOT's other version directories unused for
    :data:`KEEP_DAYS` days (another process of those versions would have marked them).  Returns
    what was removed; nothing where ROOT cannot be read or written."""
    now = time.time() if now is None else now
    removed = []
    try:
        DIRECTORY.mkdir(parents=True, exist_ok=True)
        (DIRECTORY / _USED).touch()
        for other in DIRECTORY.parent.iterdir():
            used = other / _USED
            if other != DIRECTORY and used.exists() and now - used.stat().st_mtime > KEEP_DAYS * 86400:
                shutil.rmtree(other, ignore_errors=True)
                removed.append(other)
    except OSError:
        pass
    return removed
