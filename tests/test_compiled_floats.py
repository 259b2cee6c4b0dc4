"""The F32 / F16 / BF16 compiled products (``backends/compiled/floats.py``) beyond the shared harness
(tests/test_compiled_linear.py): both code paths in one run whatever the CPU, the widening of every
F16 and BF16 bit pattern, ``K`` not a multiple of the 8 lanes, and every tile shape's rows equal.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from dist_runtime.backends.compiled import cpu, floats, linear, linear_many, set_threads  # noqa: E402
from dist_runtime.dtypes import DType  # noqa: E402
from dist_runtime.kernels.quant import dequantize, quantize  # noqa: E402

PATHS = ["portable", pytest.param("avx2", marks=pytest.mark.skipif(not cpu.AVX2, reason=cpu.REASON))]
FORMATS = {"f32": np.float32, "f16": np.float16, "bf16": DType.BF16.numpy}


def product(x: np.ndarray, w, fmt: str, path: str, threaded=False) -> np.ndarray:
    """``x @ w.T`` through the kernel of ``fmt`` on ``path`` (not only the one this CPU chose), on
    the calling thread or (``threaded``) numba's pool; ``w`` a quantized array for ``"q8_0"``."""
    x = np.ascontiguousarray(x, np.float32)
    stored = w.data if fmt == "q8_0" else w if fmt == "f32" else w.view(np.uint16)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    args = (floats.SPECS((fmt, path)), x.reshape(-1), np.ascontiguousarray(stored).reshape(-1),
            out.reshape(-1), x.shape[0], w.shape[0], x.shape[1])
    if threaded:
        floats._threaded(*args)
    else:
        floats._rows(*args, 0, w.shape[0])
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("k", [8, 1])  # the 8-lane loop, and the one-element tail
def test_every_stored_bit_pattern_widens_exactly(fmt, path, k):
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(FORMATS[fmt]).astype(np.float32)
    w = np.zeros((bits.size, k), np.uint16)
    w[:, 0] = bits
    x = np.zeros((1, k), np.float32)
    x[0, 0] = 1.0
    got = product(x, w.view(FORMATS[fmt]), fmt, path)[0]
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], want[~nan])  # -0 may come out +0: the lane sum adds zeros


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (2, 3, 7), (5, 17, 37), (9, 35, 263), (4, 2, 16),
                                     (1, 5, floats.LONE_FAR_K + 3)])  # a lone row's far-hinted tile
def test_both_paths_match_float64_for_any_k(fmt, path, m, n, k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(FORMATS[fmt])
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = product(x, w, fmt, path)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(np.max(np.abs(want)), 1.0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", list(FORMATS))
# 541: two spans, a line's pieces left over, the K mod 8 tail; LONE_FAR_K + 13: F32 lone rows far-hinted
@pytest.mark.parametrize("k", [45, 541, floats.LONE_FAR_K + 13])
def test_every_tile_shape_gives_a_row_the_same_bits(path, fmt, k):
    """M = 1..2 ROWS + 1 and N across a chunk's edge run a row through every tile shape (rows of x
    by weight rows: ROWS x COLS, half x COLS, 1 x LONE_COLS, ROWS x 1, half x 1, 1 x 1), in one span
    or several: each must equal the row alone."""
    rng = np.random.default_rng(5)
    n = floats.CHUNK + floats.COLS + 1
    x = rng.standard_normal((2 * floats.ROWS + 1, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(FORMATS[fmt])
    alone = np.concatenate([product(x[i:i + 1], w, fmt, path) for i in range(len(x))])
    for m in range(1, len(x) + 1):
        assert np.array_equal(product(x[:m], w, fmt, path).view(np.uint32), alone[:m].view(np.uint32)), m


@pytest.mark.parametrize("path", PATHS)
# one block; odd block counts (a lone row's 4 weight rows and the rest); two spans at M > 2 tiles
@pytest.mark.parametrize("k", [32, 288, 544])
def test_q8_0_gives_f32s_bits_on_the_dequantized_weight_in_every_tile_shape(path, k):
    """A Q8_0 element, ``code * d``, is exact in f32: the product must be the F32 kernel's on the
    dequantized weight, bit for bit, whatever the rows of x (every tile shape, the lone rows' four
    weight rows and the rest) and within 1e-5 of float64; NaN and inf reach their rows only."""
    rng = np.random.default_rng(k)
    rows, cols, _ = floats._shape("q8_0")  # its own tile where the CPU has 16 vector registers
    n = floats.CHUNK + cols + 2
    x = rng.standard_normal((2 * rows + 1, k)).astype(np.float32)
    x[3, 7], x[5, k - 1] = np.nan, np.inf
    q = quantize(rng.standard_normal((n, k)).astype(np.float32), DType.Q8_0)
    w = dequantize(q)
    alone = np.concatenate([product(x[i:i + 1], q, "q8_0", path) for i in range(len(x))])
    assert np.array_equal(alone.view(np.uint32), product(x, w, "f32", path).view(np.uint32))
    for m in range(1, len(x) + 1):
        assert np.array_equal(product(x[:m], q, "q8_0", path).view(np.uint32), alone[:m].view(np.uint32)), m
    fine = [i for i in range(len(x)) if i not in (3, 5)]
    want = x[fine].astype(np.float64) @ w.astype(np.float64).T
    assert np.max(np.abs(alone[fine] - want)) <= 1e-5 * np.max(np.abs(want))
    assert np.isnan(alone[3]).all() and not np.isfinite(alone[5]).any()


def test_q8_0_is_the_registered_kernel_of_f32_activations():
    """Q8_0 with f32 activations runs here (with Q8_0 activations, legacy.py's integer dots), alone
    and in a joint launch of Q8_0 weights; a joint launch mixing Q8_0 with another legacy type runs
    each product alone, with the same bits."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    qs = [quantize(rng.standard_normal((n, 256)).astype(np.float32), DType.Q8_0) for n in (40, 24)]
    want = [product(x, q, "q8_0", cpu.PATH) for q in qs]
    assert np.array_equal(linear(x, qs[0]), want[0])
    assert all(np.array_equal(a, b) for a, b in zip(linear_many(x, qs), want))
    q4 = quantize(rng.standard_normal((16, 256)).astype(np.float32), DType.Q4_0)
    mixed = linear_many(x, [qs[0], q4])
    assert np.array_equal(mixed[0], want[0]) and np.array_equal(mixed[1], linear(x, q4))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_threaded_driver_gives_the_serial_bits(threads):
    """Small products run on the calling thread alone (``SERIAL_BYTES``), so the shared harness's
    thread counts never reach the pool: compare the two drivers directly."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((5 * floats.CHUNK + 3, 100)).astype(np.float16)
    try:
        set_threads(threads)
        for m in (1, 3, 8, 13):
            x = rng.standard_normal((m, 100)).astype(np.float32)
            serial = product(x, w, "f16", cpu.PATH)
            assert np.array_equal(product(x, w, "f16", cpu.PATH, threaded=True).view(np.uint32),
                                  serial.view(np.uint32)), m
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


def test_the_registered_kernels_take_the_cpus_path():
    w = np.random.default_rng(6).standard_normal((3, 20)).astype(np.float16)
    x = np.ones((2, 20), np.float32)
    assert np.array_equal(linear(x, w), product(x, w, "f16", cpu.PATH))


@pytest.mark.slow  # two child processes
def test_the_chosen_layer_holds_when_numba_was_imported_first():
    """numba reads NUMBA_THREADING_LAYER once, at its own import: the package must still choose its
    layer (TBB when installed, else workqueue) when another module imported numba before it, and
    the threaded driver must run; a layer the user names wins."""
    code = ("import numba, numpy as np\n"
            "from dist_runtime.backends.compiled import cpu, floats, init, threads\n"
            "init()\n"
            "x, w, out = np.ones(64, np.float32), np.ones(6400, np.float32), np.empty(100, np.float32)\n"
            "floats._threaded(floats.SPECS(('f32', cpu.PATH)), x, w, out, 1, 100, 64)\n"
            "print(numba.threading_layer(), threads.LAYER, out[0])\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    layer, chosen, value = done.stdout.split()
    assert layer == chosen and layer in ("tbb", "workqueue") and value == "64.0", done.stderr
    if importlib.util.find_spec("tbb") is not None or (Path(sys.prefix) / "lib" / "libtbb.so.12").exists():
        assert layer == "tbb"  # installed (a dependency on x86-64 Linux): numba's cheap launches
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, "NUMBA_THREADING_LAYER": "workqueue"})
    assert done.stdout.split() == ["workqueue", "workqueue", "64.0"], done.stderr


def test_a_choice_passes_its_value_as_an_array_type():
    """simd.Choice: each value an empty array of its own element type (numba's fast typing path),
    read back from that numba type while generating code; up to simd.CHOICES values."""
    from numba import typeof

    from dist_runtime.backends.compiled import simd

    choice = simd.Choice(["a", ("b", 1), 3])
    assert [choice.of(typeof(choice(v))) for v in choice.values] == ["a", ("b", 1), 3]
    assert len({typeof(choice(v)) for v in choice.values}) == 3 and choice(3).size == 0
    many = simd.Choice(range(simd.CHOICES))
    assert [many.of(typeof(many(v))) for v in many.values] == list(range(simd.CHOICES))
    with pytest.raises(ValueError, match=f"at most {simd.CHOICES}"):
        simd.Choice(range(simd.CHOICES + 1))
    assert {floats.SPECS.of(typeof(floats.SPECS(v))) for v in floats.SPECS.values} == set(floats.SPECS.values)


def _against_a_guard_page(data: np.ndarray) -> tuple[np.ndarray, object]:
    """A copy of ``data`` (bytes) ending where an unreadable page begins: a read past its end faults."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    pages = -(-data.nbytes // page) + 1
    region = mmap.mmap(-1, (pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(base + pages * page, page, 0) != 0:  # PROT_NONE
        pytest.skip(f"mprotect failed (errno {ctypes.get_errno()})")
    buf = np.frombuffer(region, np.uint8, count=data.nbytes, offset=pages * page - data.nbytes)
    buf[:] = data.reshape(-1).view(np.uint8)
    return buf, region


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")
@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_the_next_chunks_hints_never_read_past_the_weight(fmt):
    """The tiles after a chunk's first pass hint the next chunk's rows (floats._TILE_AHEAD), which
    for the last full chunk lie partly past the weight: hints only, never a load (a Q8_0 block's
    scale among them), or this would fault on the page after the weight."""
    rng = np.random.default_rng(5)
    n, k, m = 2 * floats.CHUNK + 6, 256, 8  # a partial last chunk: the hints of the one before run past n
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = quantize(w, DType.Q8_0) if fmt == "q8_0" else None
    stored = q.data if q is not None else w
    guarded, region = _against_a_guard_page(np.ascontiguousarray(stored))
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = np.empty((m, n), np.float32)
    args = (floats.SPECS((fmt, cpu.PATH)), x.reshape(-1), guarded if fmt == "q8_0" else guarded.view(np.float32),
            out.reshape(-1), m, n, k)
    floats._rows(*args, 0, n)
    reference = x @ (dequantize(q) if q is not None else w).T
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
    floats._threaded(*args)
    np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
    assert not region.closed  # held to here: the guard page stays in place while the kernels run
