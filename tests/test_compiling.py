"""The notice a user gets while numba compiles the kernels (dist_runtime/compile_notice.py)."""

from __future__ import annotations

import io
import re
import threading
import time

import numba
import pytest
from numba.core import event

from dist_runtime import compile_notice as compiling


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def quick(monkeypatch):
    """Seconds, not minutes: a stretch shows after 50 ms and ends 50 ms after its last compile."""
    monkeypatch.setattr(compiling, "DELAY", 0.05)
    monkeypatch.setattr(compiling, "IDLE", 0.05)
    monkeypatch.setattr(compiling, "WAIT", 0.05)


def finished(notice, timeout: float = 10.0) -> None:
    """Wait for the stretch's watcher to end (a loaded machine may be slow to run it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with notice.lock:
            if notice.watcher is None:
                return
        time.sleep(0.01)
    raise AssertionError("the watcher did not end")


def stretch(notice, seconds: float) -> None:
    """One compile of ``seconds`` with a nested one inside, as numba compiles a caller's callees."""
    notice.started()
    notice.started()
    time.sleep(seconds)
    notice.ended()
    notice.ended()


def test_a_short_compile_says_nothing(monkeypatch):
    monkeypatch.setattr(compiling, "IDLE", 0.05)
    out = io.StringIO()
    notice = compiling._Notice("", out)
    stretch(notice, 0.01)
    finished(notice)
    assert out.getvalue() == ""


def test_a_long_compile_in_a_log_is_one_line_when_it_starts_and_one_when_it_ends(quick):
    out = io.StringIO()
    notice = compiling._Notice("stage 1: ", out)
    stretch(notice, 1.0)
    finished(notice)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"stage 1: {compiling.WHAT} ..."
    assert len(lines) == 2 and lines[1].startswith("stage 1: compiled the kernels in ")
    stretch(notice, 1.0)  # a later stretch (another model, another shape) says so again
    finished(notice)
    assert len(out.getvalue().splitlines()) == 4


def test_on_a_terminal_the_count_is_erased_before_the_program_goes_on(quick):
    out = Terminal()
    notice = compiling._Notice("", out)
    notice.started()
    time.sleep(1.0)
    shown = out.getvalue()
    assert re.search(rf"\r\x1b\[K{re.escape(compiling.WHAT)}: \d+ s", shown) and "\n" not in shown
    notice.ended()  # erased here, in the compiling thread, before it returns to the program
    assert out.getvalue().endswith("\r\x1b[K")
    finished(notice)
    assert out.getvalue().endswith("\r\x1b[K") and "\n" not in out.getvalue()


def test_numbas_compile_events_reach_the_notice(quick, monkeypatch):
    """Through numba's own events: a fresh function compiled while listening is announced."""
    monkeypatch.setattr(compiling, "DELAY", 0.0)
    out = io.StringIO()
    gate = threading.Event()

    def slow_typing(*args):  # hold the compile open long enough for the watcher to see it
        gate.wait(0.5)

    @numba.njit(cache=False)
    def fresh(x):
        return x + 1

    with event.install_listener("numba:compile", compiling.listener("", out)):
        with event.install_listener("numba:compile", _Slow(slow_typing)):
            assert fresh(1) == 2
        end = time.monotonic() + 10  # the watcher ends the stretch on its own time: a busy machine is slow
        while "compiled" not in out.getvalue() and time.monotonic() < end:
            time.sleep(0.05)
    assert out.getvalue().startswith(f"{compiling.WHAT} ...\n")
    assert re.fullmatch(rf"{re.escape(compiling.WHAT)} \.\.\.\ncompiled the kernels in \d+ s\n", out.getvalue())


class _Slow(event.Listener):
    def __init__(self, wait) -> None:
        self.wait = wait

    def on_start(self, ev) -> None:
        self.wait()

    def on_end(self, ev) -> None:
        pass


def test_the_commands_that_run_a_model_announce_compiling(monkeypatch, tmp_path):
    """dist-runtime generate (and demo, embed, pipeline, serve) install the notice; inspect does not."""
    from dist_runtime.cli import main

    calls = []
    monkeypatch.setattr(compiling, "announce", lambda *a, **k: calls.append(a))
    missing = str(tmp_path / "none.model")
    assert main(["generate", missing, "--ids", "1"]) == 1
    assert calls == [()]
    assert main(["inspect", missing]) == 1
    assert calls == [()]


def test_a_long_wait_on_other_processes_is_announced_by_a_command_only(quick, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(compiling, "_installed", [])  # whatever earlier tests in this process ran
    with compiling.waiting("the 2 stage actors", "warming up", out):  # a library user: silent
        time.sleep(0.3)
    assert out.getvalue() == ""
    monkeypatch.setattr(compiling, "_installed", [object()])  # as after announce()
    with compiling.waiting("the 2 stage actors", "warming up", out):
        pass  # quick: silent
    with compiling.waiting("the 2 stage actors", "warming up", out):
        time.sleep(1.0)
    assert re.fullmatch(r"waiting for the 2 stage actors \(warming up\) \.\.\.\nthe 2 stage actors: ready after \d+ s\n",
                        out.getvalue())
    with pytest.raises(TimeoutError):  # a wait that fails is not "ready"
        with compiling.waiting("the 3 stage actors", "warming up", out):
            time.sleep(1.0)
            raise TimeoutError
    assert out.getvalue().endswith("waiting for the 3 stage actors (warming up) ...\n")
