"""benchmarks/bench_matvec.py: its flush weights (the untimed products of the measured kind) and a
whole run at a tiny size, so that the script the README's figures come from keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dist_runtime.dtypes import DType
from dist_runtime.tensor import QuantizedArray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_matvec import flush_buffer, flush_weights  # noqa: E402


def test_flush_buffer_reads_as_normal_floats_in_every_float_type():
    buffer = flush_buffer(1 << 16)
    for dtype in (np.float32, np.float16):
        values = buffer.view(dtype)
        assert np.isfinite(values).all()
        assert (np.abs(values) >= np.finfo(dtype).tiny).all()  # no zero, no subnormal
    bf16 = (buffer.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert np.isfinite(bf16).all() and (np.abs(bf16) >= np.finfo(np.float32).tiny).all()


@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_K, DType.Q6_K],
                         ids=lambda d: d.name)
def test_flush_weights_are_disjoint_views_of_the_buffer(dtype):
    n, k = 8, 512
    buffer = flush_buffer(3 * n * k * 4 + 5)
    weights = flush_weights(dtype, n, k, buffer)
    data = [w.data if isinstance(w, QuantizedArray) else w for w in weights]
    assert len(weights) == buffer.nbytes // data[0].nbytes
    assert all(np.shares_memory(d, buffer) for d in data)
    assert not any(np.shares_memory(a, b) for i, a in enumerate(data) for b in data[i + 1:])
    for w in weights:
        assert tuple(w.shape) == (n, k)
        assert (w.dtype if isinstance(w, QuantizedArray) else DType.from_numpy(w.dtype)) == dtype


@pytest.mark.slow  # the benchmark in a subprocess
def test_a_tiny_run_prints_every_product_against_numpy():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_matvec.py"), "--n", "64", "--k", "256",
                          "--ms", "1", "--runs", "1", "--flush-mb", "1"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| compiled")]
    assert any("Q4_K q8 act." in r for r in rows) and any("compiled F32 " in r for r in rows)
    assert all(r.rstrip().endswith("x) |") for r in rows), rows
    assert "a product of the measured kind each" in run.stdout


@pytest.mark.slow  # the ggml child in a subprocess
def test_the_llama_cpp_reference_checks_its_products_and_answers_seconds():
    pytest.importorskip("llama_cpp")  # not a project dependency: CI has none
    child = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "ggml_matvec_child.py"), "64", "256", "1,2",
                              str(1 << 16), "1", "q8_0,q4_0,q4_K"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT / "benchmarks")
    out, _ = child.communicate("q4_0 1\nq8_0 2\nq4_K 1\nf32 1\n\n", timeout=300)
    assert child.returncode == 0
    ready, *answers = out.splitlines()
    info = json.loads(ready.removeprefix("ready "))
    assert not info["numba_loaded"] and info["repacked"] == ["q4_0", "q4_K"]
    assert set(info["errors"]) == {"q8_0", "q4_0", "q4_K"} and all(e < 0.05 for e in info["errors"].values())
    seconds = [float(a) for a in answers]
    assert all(0 < s < 1 for s in seconds[:3]) and np.isnan(seconds[3])  # a type it was not given


@pytest.mark.slow  # the benchmark in a subprocess
def test_a_k_that_some_blocks_do_not_divide_leaves_those_types_out():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_matvec.py"), "--n", "16", "--k", "96",
                          "--ms", "1", "--runs", "1", "--flush-mb", "1", "--no-llama-cpp"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "left out: Q4_K, Q5_K, Q6_K (their blocks do not divide K = 96)" in run.stdout
    assert "| compiled Q8_0 " in run.stdout and "| compiled Q4_K" not in run.stdout
    assert "llama.cpp: no rows (--no-llama-cpp)" in run.stdout
