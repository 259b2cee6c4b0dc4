"""Run a compiled function on threads of numba's pool, called by its address.

A ``prange`` loop's body becomes a function of numba's own (a gufunc and two wrappers) into which
numba links the code of every function the body calls, and optimises it again there, four callers
deep: a large callee is optimised and compiled several times over.  The executor's program
(``program/vm.py``: ~7 s each on this 2-core machine) and the attention's threaded driver
(:mod:`.attention`: 15 s a head size against 8 this way) call theirs here instead: the callee is
compiled once, as any function (and cached on disk), and :func:`_launch`, which calls it through
its address, is a few lines.  Each thread runs the callee once with the same arguments: the
callee takes its work from a counter in them (:mod:`.spin`).
"""

from __future__ import annotations

import numba
from numba import prange, types
from numba._dispatcher import compute_fingerprint
from numba.core import cgutils
from numba.extending import intrinsic

from .cache import jit


@intrinsic
def _call(typingctx, address, args):
    """Call the compiled function at ``address`` (numba's calling convention, returning None:
    :func:`address`) with the tuple ``args``, its arguments in order; an exception it raises goes
    on up."""
    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.none, args.types)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        status, _ = context.call_conv.call_function(builder, fn, types.none, args.types,
                                                    cgutils.unpack_tuple(builder, llargs[1]))
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()
    return types.none(address, args), codegen


@jit(nogil=True, parallel=True)
def _launch(address, args, threads):
    """The function at ``address`` on ``threads`` threads of numba's pool, each with ``args``."""
    if threads == 1:
        _call(address, args)
    else:
        for _ in prange(threads):
            _call(address, args)


#: Compiled functions' addresses, by dispatcher and their arguments' numba fingerprints.
_ADDRESSES: dict[tuple, int] = {}


def address(dispatcher, args: tuple) -> int:
    """The address of ``dispatcher`` compiled for ``args``' types (compiled, or loaded from the
    cache, on first use)."""
    key = (dispatcher, compute_fingerprint(args))
    found = _ADDRESSES.get(key)
    if found is None:
        signature = numba.typeof(args).types
        dispatcher.compile(signature)
        compiled = dispatcher.overloads[signature]
        found = _ADDRESSES[key] = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
    return found


def run(dispatcher, args: tuple, threads: int) -> None:
    """``dispatcher(*args)`` on each of ``threads`` threads at once, returning when all are done."""
    _launch(address(dispatcher, args), args, threads)


def signature(args: tuple, threads) -> tuple:
    """:func:`_launch`'s argument types for a callee taking ``args`` (numba types) and ``threads``'
    type (what compiling ahead compiles: :mod:`.ahead`)."""
    return types.int64, types.BaseTuple.from_types(args), threads
