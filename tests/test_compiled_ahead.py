"""Compiling the program ahead in a child process (compiled/ahead.py): the child is told what to
compile by argument types alone, as JSON, and compiles exactly the code the caller would have;
meanwhile the caller runs the steps one by one (the same bits), then loads the child's code from
the cache and runs the program, never compiling it itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

import dist_runtime.backends.program.vm as vm
from dist_runtime.backends.compiled import ahead, cache, cpu, launch
from dist_runtime.backends.compiled import attention as compiled_attention

from test_program import HEAD64, executors


def _samples():
    a = np.zeros((3, 4), np.float32)
    frozen = np.zeros(5, np.int64)
    frozen.flags.writeable = False
    return [a, frozen, np.zeros((2, 3, 4), np.uint8), np.asfortranarray(a), a[:, ::2], np.zeros(2, np.float16),
            np.int64(3), np.float32(1.5), True, 7, 2.0, (a, 3), ((a, frozen), np.int32(1)), (1, 2, 3)]


@pytest.mark.parametrize("value", _samples(), ids=lambda v: type(v).__name__)
def test_a_type_survives_its_json_form(value):
    ty = numba.typeof(value)
    text = json.dumps(ahead.describe(ty))
    assert ahead.rebuild(json.loads(text)) == ty


def test_what_has_no_json_form_is_refused():
    with pytest.raises(TypeError, match="no JSON form"):
        ahead.describe(numba.typeof([1, 2]))
    for junk in (["array", "<f4"], ["scalar", "pyobject"], ["dict", []]):
        with pytest.raises((ValueError, TypeError)):
            ahead.rebuild(junk)


def test_the_child_is_told_the_signatures_execute_compiles(monkeypatch):
    """vm._signatures gives _work's and _launch's argument types as execute() compiles them: the
    child compiles what the caller will load, not a near miss that would leave it cold."""
    seen = []
    real = vm.execute
    monkeypatch.setattr(vm, "execute", lambda *args: (seen.append(args), real(*args))[1])
    ex, _ = executors(HEAD64)
    ex.run({"tokens": np.asarray([3, 17, 42], np.int32)})
    assert seen
    code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, threads, spec, kernels = seen[0]
    given = tuple(numba.typeof(a) for a in (code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts,
                                            positions, threads, spec, *kernels))
    prepared = vm._prepare.overloads[vm._prepare_types(given)]
    work, launched = vm._signatures(given, prepared.signature.return_type)
    assert work in vm._work.overloads and launched in launch._launch.overloads
    assert vm._loaded(given)
    assert not ahead.enabled() and vm.ready(*seen[0])  # a library caller: compiles on the call


def test_the_attention_s_child_compiles_what_a_long_context_runs():
    """compiled_attention._compiled gives the serial driver's, the threaded one's worker's and its
    launch's argument types as a context past SERIAL_KV_BYTES runs them (read-only K/V, as a KV
    cache hands them out): what warm() has a child compile is what the threaded pass loads."""
    head_dim, heads, keys = 64, 4, 2048
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, heads * head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((keys, head_dim), dtype=np.float32) for _ in range(2))
    k.flags.writeable = v.flags.writeable = False
    out = np.empty_like(q)
    if numba.get_num_threads() == 1:
        pytest.skip("one thread: every attention runs the serial driver")
    assert not compiled_attention.serial(1, keys, k.nbytes)  # the threaded driver, then the serial one
    compiled_attention.attention_rows(q, k, v, heads, 1, head_dim, True, 0, out)
    compiled_attention.attention_rows(q, k[:5], v[:5], heads, 1, head_dim, True, 0, out)  # the serial driver
    spec = compiled_attention.SPECS((cpu.PATH, head_dim))
    given = tuple(numba.typeof(a) for a in (spec, q, k, v, heads, 1, head_dim, True, 0, out))
    for dispatcher, signature in compiled_attention._compiled(given):
        assert tuple(signature) in dispatcher.overloads, dispatcher


def test_a_child_that_failed_leaves_the_compile_to_the_caller(monkeypatch, tmp_path):
    monkeypatch.setattr(cache, "DIRECTORY", tmp_path)
    monkeypatch.setattr(ahead, "_jobs", {})
    monkeypatch.setattr(ahead, "_queue", [])
    assert ahead.running("no.such.module", ["x"])  # started
    ahead._jobs[next(iter(ahead._jobs))].wait(timeout=120)
    assert not ahead.running("no.such.module", ["x"])  # ended (it failed): the caller compiles


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numba
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from test_program import HEAD64, RUNS, executors, same_bits
    import dist_runtime.backends.program.vm as vm
    from dist_runtime.backends.compiled import ahead, launch

    calls = []
    real = vm.execute
    vm.execute = lambda *args: (calls.append(args), real(*args))[1]
    ahead.enable()
    ex, steps = executors(HEAD64)
    passes, first, deadline = 0, None, time.monotonic() + 600
    while first is None or passes < first + 3:
        for tokens, pos in RUNS:
            ids = np.asarray(tokens, np.int32)
            got, want = (e.run({"tokens": ids}, pos=pos)["logits"] for e in (ex, steps))
            assert same_bits(got, want), passes
            passes += 1
            if first is None and calls:
                first = passes
        ex.reset(); steps.reset()
        assert time.monotonic() < deadline, "the child never made the program ready"
        time.sleep(0.2)
    code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, threads, spec, kernels = calls[0]
    given = tuple(numba.typeof(a) for a in (code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts,
                                            positions, threads, spec, *kernels))
    _, launched = vm._signatures(given, vm._prepare.overloads[vm._prepare_types(given)].signature.return_type)
    # the program's launch alone: the attention's steps meanwhile compile their own in-process
    print(json.dumps({"first": first, "passes": passes, "calls": len(calls),
                      "misses": sum(vm._work._cache_misses.values()) + launch._launch._cache_misses.get(launched, 0)}))
""")


@pytest.mark.slow  # a child compiles the program, ~20 s of one core
def test_the_steps_run_until_the_child_has_compiled_the_program(tmp_path):
    """On a cache without the program: the first passes run step by step (the same bits), a child
    compiles the program into the cache, and the passes after it run the program loaded from there."""
    fresh = tmp_path / "cache" / cache.VERSION
    compiled = cache.DIRECTORY / "backends" / "compiled"
    if compiled.exists():  # the kernels the steps run, warm; the program cold
        shutil.copytree(compiled, fresh / "backends" / "compiled")
    root = cache.PACKAGE.parent
    env = {**os.environ, "DIST_RUNTIME_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(root / "tests")], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["first"] > 1  # the first pass did not wait for the program
    assert got["calls"] >= 3 and got["misses"] == 0  # then it ran, never compiled in this process
    assert list((fresh / "backends" / "program").glob("vm._work-*.nbi"))
