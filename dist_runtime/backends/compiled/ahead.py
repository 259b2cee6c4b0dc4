"""Compiling in a child process while this one goes on without the compiled code.

A model's compiled program (:mod:`..program.vm`) is one large function: on a 2-core machine it
compiles in ~20 s, against a few seconds for the step-by-step kernels it replaces, which compute
the same bits.  On a cold cache a command need not make its first token wait for both: with
compiling ahead enabled (:func:`enable`: the command line and the stage actors do), a program
whose code is not in the cache is compiled by a child process into the shared cache
(:mod:`.cache`) while this process runs its passes step by step; the first pass after the child
ends loads the program from the cache (milliseconds) and runs it from then on.

A library caller that has not enabled it compiles in-process on the first call, as numba does.
At most one child compiles a given signature on a machine at a time (a lock file in the cache).
A command that ends before its child does leaves the child to finish (it runs in a session of
its own, so a Ctrl-C at the terminal does not stop it either): the next command then starts
warm, where stopping it would have made every short command start cold.  The child is told what to compile by the
argument types alone, as JSON (:func:`describe`): nothing is pickled.  Where the child fails,
the caller compiles in-process on its next call, and any error is raised there.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import subprocess
import sys

import numpy as np
from numba.core import types
from numba.np import numpy_support

from . import cache

_SCALARS = {str(t): t for t in (types.boolean, *types.integer_domain, *types.real_domain)}
_enabled = False
_jobs: dict[str, subprocess.Popen] = {}
_queue: list[tuple[str, str, str]] = []


def enable(on: bool = True) -> None:
    """Compile programs ahead in a child process from now on (or, ``on=False``, in-process)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def describe(ty) -> object:
    """A numba argument type as JSON: arrays, integers, floats, booleans and tuples of them."""
    if isinstance(ty, types.Array):
        return ["array", numpy_support.as_dtype(ty.dtype).str, ty.ndim, ty.layout, ty.mutable, ty.aligned]
    if isinstance(ty, types.BaseTuple):
        return ["tuple", [describe(t) for t in ty.types]]
    if isinstance(ty, (types.Integer, types.Float, types.Boolean)):
        return ["scalar", str(ty)]
    raise TypeError(f"no JSON form for the numba type {ty}")


def rebuild(obj) -> object:
    """The numba type :func:`describe` gave ``obj`` for."""
    kind, *rest = obj
    if kind == "array":
        dtype, ndim, layout, mutable, aligned = rest
        return types.Array(numpy_support.from_dtype(np.dtype(dtype)), ndim, layout,
                           readonly=not mutable, aligned=aligned)
    if kind == "tuple":
        return types.Tuple([rebuild(t) for t in rest[0]])
    if kind == "scalar" and rest[0] in _SCALARS:
        return _SCALARS[rest[0]]
    raise ValueError(f"not a described numba type: {obj!r}")


def load(dispatcher, signature: tuple):
    """``dispatcher``'s compiled code for ``signature``, from this process or numba's cache
    (added to the dispatcher as its own ``compile`` adds a cache hit), or None: never compiles."""
    signature = tuple(signature)
    if signature in dispatcher.overloads:
        return dispatcher.overloads[signature]
    compiled = dispatcher._cache.load_overload(signature, dispatcher.targetctx)
    if compiled is None:
        return None
    dispatcher.targetctx.insert_user_function(compiled.entry_point, compiled.fndesc, [compiled.library])
    dispatcher.add_overload(compiled)
    return compiled


def running(module: str, payload: object) -> bool:
    """Whether a child compiling ``payload`` (``module.compile_ahead(payload)``) is still to end;
    queues one on the first ask.  One child runs at a time (each compiles on one core: the other
    runs this process's first passes), the next started when this is asked after it ended.
    False once it has ended, whatever its outcome."""
    text = json.dumps(payload, sort_keys=True)
    key = hashlib.sha256(f"{module}\0{text}".encode()).hexdigest()[:24]
    if key not in _jobs and key not in (k for k, _, _ in _queue):
        _queue.append((key, module, text))
    _advance()
    job = _jobs.get(key)
    return job is None or job.poll() is None


def _advance() -> None:
    """Start the next queued child if none is running."""
    if _queue and all(job.poll() is not None for job in _jobs.values()):
        key, module, text = _queue.pop(0)
        # this process's copy of the package first: the child must compile into this one's cache
        path = os.pathsep.join(filter(None, [str(cache.PACKAGE.parent), os.environ.get("PYTHONPATH")]))
        _jobs[key] = subprocess.Popen([sys.executable, "-m", __name__, module, key, text],
                                      env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main(argv: list[str]) -> int:
    """The child: ``module key payload``; compiles unless another child holds ``key``'s lock
    (then waits for it to end: its code is then in the cache)."""
    from . import init

    init()  # the threading layer (TBB's library loaded) before compiling parallel code
    module, key, text = argv
    cache.DIRECTORY.mkdir(parents=True, exist_ok=True)
    with open(cache.DIRECTORY / f".ahead-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another child compiling the same: wait, then load it
        importlib.import_module(module).compile_ahead(json.loads(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
