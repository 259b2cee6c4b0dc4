"""What a user is told while numba compiles the kernels.

The compiled kernels and the program (:mod:`.backends.compiled`, :mod:`.backends.program`) are
compiled for this CPU on first use and cached (:mod:`.backends.compiled.cache`: per user and
machine, ``~/.cache/dist-runtime`` by default).  On a cold cache -- a fresh install, an upgrade, another CPU -- a tiny
model's first ``generate`` would sit silent for tens of seconds on this 2-core machine before its
first token.  :func:`announce` listens to numba's compile events and, once a stretch
of compiling has gone on for :data:`DELAY` seconds, says so on stderr: on a terminal a count of
seconds, rewritten in place and erased the moment compiling stops (before the program prints
anything else); elsewhere (a log) one line when it starts and one when it ends (unless the
process ends first, say interrupted mid-compile).  A warm cache
loads in milliseconds and prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

#: Seconds of compiling before anything is printed (a cache load or a small compile is quieter).
DELAY = 2.0
#: Seconds a wait on other processes (:func:`waiting`) lasts before it is announced: loading a
#: stage's weights alone takes a few.
WAIT = 5.0
#: Seconds without a compile that end a stretch (numba compiles a call's functions one by one,
#: with a little Python between them).
IDLE = 0.5
#: What the notice says; short, since a terminal line that wraps cannot be rewritten in place.
WHAT = "compiling kernels for this CPU, once (numba caches them)"

_installed: list = []


def announce(prefix: str = "", stream=None) -> None:
    """Tell the user (on ``stream``, default stderr) whenever numba compiles for more than
    :data:`DELAY` seconds; ``prefix`` starts each line (a stage's name).  Idempotent."""
    if not _installed:
        from numba.core import event

        _installed.append(listener(prefix, stream or sys.stderr))
        event.register("numba:compile", _installed[0])


@contextmanager
def waiting(what: str, why: str, stream=None):
    """Say on ``stream`` (default stderr) that the program is waiting for ``what`` (and ``why``)
    if the block takes more than :data:`WAIT` seconds, then how long it took; silent unless :func:`announce`
    was called (a command, not a library user).  For waits on other processes that may be
    compiling: a pipeline's stage actors warming up, whose own notices stay in their logs."""
    if not _installed:
        yield
        return
    stream = stream or sys.stderr
    said, done, lock, start = [], threading.Event(), threading.Lock(), time.monotonic()

    def say() -> None:
        if not done.wait(WAIT):
            with lock:  # not once the wait is over: a "waiting" line with no end
                if not done.is_set():
                    said.append(True)
                    _write(stream, f"waiting for {what} ({why}) ...\n")
    threading.Thread(target=say, name="wait-notice", daemon=True).start()
    try:
        yield
    finally:  # a failed wait says nothing more: its error is what the user reads next
        with lock:
            done.set()
    if said:
        _write(stream, f"{what}: ready after {time.monotonic() - start:.0f} s\n")


def listener(prefix: str, stream):
    """A listener for numba's ``numba:compile`` events that tells ``stream`` (see :func:`announce`)."""
    from numba.core import event

    notice = _Notice(prefix, stream)

    class _Listener(event.Listener):
        def on_start(self, ev) -> None:
            notice.started()

        def on_end(self, ev) -> None:
            notice.ended()

    return _Listener()


class _Notice:
    """Compile events in, text out.  A watcher thread per stretch of compiling prints once the
    stretch is :data:`DELAY` seconds old; the stretch ends :data:`IDLE` seconds after its last
    compile.  Writes happen under the lock, so the erasing in :meth:`ended` never races a rewrite."""

    def __init__(self, prefix: str, stream) -> None:
        self.prefix, self.stream = prefix, stream
        self.live = bool(getattr(stream, "isatty", lambda: False)())
        self.lock = threading.Lock()
        self.depth = 0  # compiles under way (numba nests them: a caller compiles its callees)
        self.last = 0.0  # when the last one ended
        self.since = 0.0  # when the stretch began
        self.watcher: threading.Thread | None = None
        self.on_screen = False  # a live count is showing
        self.opened = False  # a log line said compiling began, and none yet that it ended

    def started(self) -> None:
        with self.lock:
            self.depth += 1
            if self.watcher is None:
                self.since = time.monotonic()
                self.watcher = threading.Thread(target=self._watch, name="compile-notice", daemon=True)
                self.watcher.start()

    def ended(self) -> None:
        with self.lock:
            self.depth -= 1
            self.last = time.monotonic()
            if self.depth == 0 and self.on_screen:  # erase it now, before the program prints on
                self._write("\r\x1b[K")
                self.on_screen = False

    def _watch(self) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                if self.depth == 0 and now - self.last >= IDLE:  # the stretch is over
                    self.watcher = None
                    if self.opened:  # (a process that ends first, interrupted say, says no more)
                        self._write(f"{self.prefix}compiled the kernels in {self.last - self.since:.0f} s\n")
                        self.opened = False
                    return
                elapsed = now - self.since
                if elapsed >= DELAY and self.depth > 0:
                    if self.live:
                        self._write(f"\r\x1b[K{self.prefix}{WHAT}: {elapsed:.0f} s")
                        self.on_screen = True
                    elif not self.opened:
                        self._write(f"{self.prefix}{WHAT} ...\n")
                        self.opened = True
            time.sleep(0.1 if elapsed < DELAY else 0.5)

    def _write(self, text: str) -> None:
        _write(self.stream, text)


def _write(stream, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # a closed stream: the notice is not worth an error
        pass
