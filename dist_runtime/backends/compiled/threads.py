"""Which threading layer runs the compiled products' threads, chosen once at import, with the
reason (``inspect --plan``).

TBB when its library is installed (the ``tbb`` wheel, a dependency on x86-64 Linux): a parallel
launch costs ~1.6 us here against ~51 us for numba's own ``workqueue`` pool, which is what kept
every product under 8 MB on one core (a 125M model's are all but the lm_head), and its idle
workers sleep rather than spin for long, so two stage processes on one machine do not fight
(OpenMP's layer, measured here, made two threads beside a busy core 2x slower than one).
``NUMBA_THREADING_LAYER`` set by the user wins.

That sleep has its price, measured here (session 14, an empty two-task launch after the calling
thread ran alone for a while; medians of 300): 1.7 us after 5 us, ~3 us after 10-20 us, 12 us
after 50 us, 15 us after 100 us and 43 us after 1 ms, the caller waiting for its worker to wake.
A decode step's product after the attention of its layer (~60 us on the calling thread) pays it
each time; waking the worker ahead of time costs the caller the same wait (an empty launch, 14
us); running the smaller products on the calling thread instead (every product under 2.5 MB)
measured 0.98-0.99x the step's time, within this machine's noise, so nothing was changed.
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


LAYER, REASON = _choose()
