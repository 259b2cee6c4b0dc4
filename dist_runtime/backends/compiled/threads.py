"""Which threading layer runs the compiled products' threads: chosen once by :func:`init`, with
the reason (``inspect --plan``).

TBB when its library is installed (the ``tbb`` wheel, a dependency on x86-64 Linux): a parallel
launch costs ~1.6 us here against ~51 us for numba's own ``workqueue`` pool, which would keep every
product under 8 MB on one core (a 125M model's are all but the lm_head), and its idle workers
sleep rather than spin for long, so two stage processes on one machine do not fight (OpenMP's
layer made two threads beside a busy core 2x slower than one).  ``NUMBA_THREADING_LAYER`` set by
the user wins.

That sleep has its price (an empty two-task launch after the calling thread ran alone for a while;
medians of 300): 1.7 us after 5 us, ~3 us after 10-20 us, 12 us after 50 us, 15 us after 100 us
and 43 us after 1 ms, the caller waiting for its worker to wake.  The compiled program
(``program/vm.py``) keeps its threads for a whole pass and so pays it once a pass.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


def _load_tbb() -> str | None:
    """Load the tbb wheel's library where numba's TBB pool finds it; returns why not, or None.

    The wheel puts ``libtbb.so.12`` in the environment's ``lib/``, which is not on the loader's
    path and not in the pool's rpath: loaded first, globally, it satisfies the pool by name."""
    for folder in (Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"):
        lib = folder / "libtbb.so.12"
        if lib.exists():
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                import numba.np.ufunc.tbbpool  # noqa: F401 -- the pool's extension loads against it
            except (OSError, ImportError) as e:
                return f"TBB found but not loadable ({e})"
            return None
    try:
        import numba.np.ufunc.tbbpool  # noqa: F401 -- a system-wide TBB
    except ImportError:
        return "no TBB library (pip install tbb)"
    return None


def _choose() -> tuple[str, str]:
    asked = os.environ.get("NUMBA_THREADING_LAYER")
    # Loaded whenever TBB may be used: a process started by one that chose TBB (a stage actor)
    # inherits the variable, not the loaded library.
    problem = _load_tbb() if asked in (None, "", "tbb") else None
    if asked:
        return asked, f"NUMBA_THREADING_LAYER={asked}" + (f" ({problem})" if problem else "")
    if problem is None:
        return "tbb", "TBB threads (a launch costs ~2 us)"
    return "workqueue", f"numba's workqueue threads ({problem}; a launch costs ~50 us)"


#: The layer and why, once :func:`init` has run (``None`` / "not chosen yet" before).
LAYER: str | None = None
REASON = "threading layer not chosen yet"


def init() -> None:
    """Choose the layer, load TBB's library for it, and set it for numba and for the processes
    this one starts (the stage actors inherit ``NUMBA_THREADING_LAYER``); idempotent."""
    global LAYER, REASON
    if LAYER is not None:
        return
    LAYER, REASON = _choose()
    os.environ.setdefault("NUMBA_THREADING_LAYER", LAYER)
    import numba

    # numba reads the variable when first imported, which may have happened before: then its
    # config is set too, which counts until the first parallel launch.
    if numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = LAYER
