"""What every ``dist-runtime`` command shares: argument types, exit statuses, and running one
command with the project's errors turned into one line.  Light on purpose: building the parsers
(``dist-runtime --help``) imports this and argparse, never numpy or Ray."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import DistRuntimeError
from .scheduling_defaults import DEFAULT_KV_DTYPE, KV_DTYPE_NAMES, NUMERICS_NAMES
from .units import parse_bytes

#: Exit statuses: a problem with the model, the plan or the run; a usage error (argparse's);
#: Ctrl-C, as a shell reports a process that SIGINT ended (128 + 2).
FAILED, USAGE, INTERRUPTED, TERMINATED = 1, 2, 128 + 2, 128 + 15


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it is torn down as Ctrl-C tears it down
    (pipelines closed, an embedded Ray stopped) and exits with one line, not a stack dump."""


#: The interrupt a signal raised, kept until :func:`run_command` has handled it: a raise inside a
#: callback from C (numba compiling a kernel calls back into Python through ctypes) is printed as
#: "Exception ignored" and lost, and the command would run on; :func:`check_signals` raises it again.
_pending: list[KeyboardInterrupt] = []


def raise_terminated(signum, frame) -> None:
    _pending.append(Terminated())
    raise _pending[-1]


def raise_interrupted(signum, frame) -> None:
    _pending.append(KeyboardInterrupt())
    raise _pending[-1]


def check_signals() -> None:
    """Raise again an interrupt that a signal raised where it could not propagate (call it from
    a loop's steps, e.g. for each token printed)."""
    if _pending:
        raise _pending[-1]


def _quiet_lost_interrupts(unraisable) -> None:
    """``sys.unraisablehook``: an interrupt dropped in a callback is not a stack dump for the
    user (:func:`check_signals` raises it again); anything else is reported as Python would."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _pending:
        return
    sys.__unraisablehook__(unraisable)


def handle_sigterm() -> None:
    """SIGTERM raises :class:`Terminated` and SIGINT ``KeyboardInterrupt`` in the main thread,
    both remembered for :func:`check_signals` (a command's ``main`` calls this)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_terminated)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, raise_interrupted)
        sys.unraisablehook = _quiet_lost_interrupts


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    return _whole(text, 1)


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    return _whole(text, 0, 65535)


def _whole(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be at least {low}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"{value} must be at most {high}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (seconds, CPUs)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def size(text: str) -> int:
    """argparse type: a byte size such as 8GiB or 512MB."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def token_ids(text: str) -> list[int]:
    """argparse type: comma- or space-separated token ids, each >= 0, at least one."""
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError("give at least one token id, each >= 0")
    return ids


def add_kv_dtype(p, what: str = "the KV caches keep K and V in") -> None:
    """``--kv-dtype``: one option, the same on generate, pipeline, serve and partition."""
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES,
                   help=f"what {what}: f16, half f32's memory at the same speed (logits within ~1e-3 "
                        f"of f32's); q8_0, 17/32 of f16's at the same speed (logits within ~2e-2); or f32 "
                        f"(default: the model's kv_dtype metadata, else {DEFAULT_KV_DTYPE})")


def add_numerics(p) -> None:
    """``--numerics``: one option, the same on generate, pipeline, serve and inspect."""
    p.add_argument("--numerics", choices=NUMERICS_NAMES, default=NUMERICS_NAMES[0],
                   help="how quantized weights are multiplied: auto, each weight type's faster way "
                        "(GGML block types with Q8_0 activations, as llama.cpp; float types in f32); f32 "
                        "activations everywhere (closest to the unquantized model); or q8 everywhere "
                        "(default: %(default)s)")


def run_command(func, args: argparse.Namespace) -> int:
    """``func(args)``, with the project's errors turned into a message and exit status 1."""
    try:
        try:
            return func(args)
        except Exception:
            # A Ctrl-C lost in a callback from C can break what it interrupted with an error of
            # its own (numba, compiling: "no compiled object yet"): the interrupt is the cause.
            if _pending:
                raise _pending[-1] from None
            raise
    except DistRuntimeError as e:
        if getattr(args, "json", False):
            print(json.dumps({"valid": False, "error": type(e).__name__, "message": str(e)}, indent=2))
        else:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return FAILED
    except OSError as e:
        print(f"error: cannot open {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what was printed stands; no traceback
        _pending.clear()
        what = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"\ndist-runtime {getattr(args, 'command', '') or ''}: {what}".rstrip(), file=sys.stderr)
        return TERMINATED if isinstance(e, Terminated) else INTERRUPTED
