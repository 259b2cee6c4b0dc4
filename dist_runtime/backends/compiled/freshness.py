"""Keeping numba's on-disk cache of the compiled kernels true to their sources.

numba keys a cached function by its own file's contents, not by the files whose code it inlines
or calls: ``kquants.py``'s drivers hold ``registry.joint_chunks`` and the IR that ``simd_k.py``
emits, compiled in.  After a change to those files alone (an edit, a ``git pull``, a checkout of
another branch), the callers' cached code would still be the old kernels, with no error.  So,
once per process (:func:`.init`), before anything is compiled or loaded, :func:`refresh` compares a digest of
every source whose code is cached, or compiled into cached code, with the digest stored beside the
cache; when they differ it deletes those sources' cached code, so that numba compiles it anew,
and stores the new digest.

It reaches the cache numba keeps beside the sources (``__pycache__``, and the portable path's
subdirectory of the package's, where the numba backend's code is cached too); where that directory
cannot be written (an installed, read-only copy) numba caches elsewhere, and an upgrade there
replaces every file, which numba notices by itself.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def digest(sources: list[Path]) -> str:
    """One SHA-256 over the sources' names and contents, in name order."""
    h = hashlib.sha256()
    for path in sorted(sources, key=lambda p: p.name):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def refresh(sources: list[Path], stamp: Path) -> bool:
    """Delete the cached code of ``sources`` (numba's ``<name>.*.nbi`` / ``.nbc`` under the
    ``__pycache__`` beside any of them, subdirectories included) unless ``stamp`` holds their
    :func:`digest`, then store it there.  Returns whether the digest had changed (the cached code
    cleared); False too where a file cannot be read or written."""
    try:
        current = digest(sources)
        if stamp.exists() and stamp.read_text() == current:
            return False
        for cache in {path.parent / "__pycache__" for path in sources}:
            for pattern in (f"{path.stem}.*.nb{kind}" for path in sources for kind in "ic"):
                for old in cache.rglob(pattern):
                    old.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
        partial.write_text(current)
        partial.replace(stamp)  # atomic: another process reads the old digest or the new one
    except OSError:
        return False
    return True


#: The sources of the cached compiled code: this package's modules, and the compiled program's,
#: which compile the package's kernels in.
PACKAGE = Path(__file__).resolve().parent
SOURCES = sorted(PACKAGE.glob("*.py")) + sorted((PACKAGE.parent / "program").glob("*.py"))
STAMP = PACKAGE / "__pycache__" / "sources.sha256"
