"""OpenBLAS's worker threads, sent to sleep once a pass that used them is over.

After a threaded call OpenBLAS's workers busy-wait for the next one (about 2**28 cycles, ~0.1 s
here) before they sleep.  A long prefill's F32 products go to BLAS (``numba.BLAS_ROWS``); the
decode steps that follow then share the cores with a spinning worker, and the compiled products'
threads lose: after a 1024-row prefill of the 125M Llama the first 5 decode steps took 22-35 ms
against 13-16 ms once the worker slept, with its threads shut down at once 14-17 ms from the
first (one run, ``benchmarks/bench_decode.py``'s model).  :func:`rest` shuts them down
(``blas_thread_shutdown_``, exported by every OpenBLAS build numpy ships); the next BLAS call
starts them again (~0.1 ms).  The environment's ``OPENBLAS_THREAD_TIMEOUT`` would do it too, but
only if set before numpy loads OpenBLAS, which a library cannot ensure.

The library is the one this process loaded (found in ``/proc/self/maps``), so that numpy's
bundled copy is the one told.  Where none is loaded, or it lacks the symbol, :func:`rest` does
nothing and :data:`REASON` says why.

Shutting the workers down while another thread is inside BLAS would take its work from under it,
so executors run their passes inside :func:`pass_running` and :func:`rest` does nothing while any
pass, in any thread, is running (a server's generation and embedding threads); BLAS that code
outside the executors calls from other threads at the same time is not covered.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np  # noqa: F401 -- numpy's OpenBLAS must be loaded before the maps are read


def _find() -> tuple[object | None, str]:
    """The loaded OpenBLAS's shutdown function, or None, and why."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError as e:
        return None, f"no /proc/self/maps ({e.strerror})"
    paths = sorted({line.split(maxsplit=5)[-1] for line in maps.splitlines()
                    if "openblas" in line.lower() and ".so" in line})
    for path in paths:
        try:
            shutdown = getattr(ctypes.CDLL(path), "blas_thread_shutdown_")
        except (OSError, AttributeError):
            continue
        shutdown.restype, shutdown.argtypes = ctypes.c_int, []
        return shutdown, f"OpenBLAS's workers sleep after a pass that used them ({Path(path).name})"
    return None, "no loaded OpenBLAS with blas_thread_shutdown_: its workers spin until their timeout"


_SHUTDOWN, REASON = _find()


_LOCK = threading.Lock()
_running = 0  # executor passes in flight, in every thread


@contextmanager
def pass_running():
    """Around an executor pass: :func:`rest` waits for none."""
    global _running
    with _LOCK:
        _running += 1
    try:
        yield
    finally:
        with _LOCK:
            _running -= 1


def rest() -> bool:
    """Shut OpenBLAS's worker threads down now (the next BLAS call starts them); False where that
    is not possible (:data:`REASON`) or a pass is running in some thread."""
    with _LOCK:  # no pass starts while the workers go
        if _SHUTDOWN is None or _running:
            return False
        _SHUTDOWN()
        return True
