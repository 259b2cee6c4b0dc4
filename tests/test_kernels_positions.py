"""The position kernels (kernels/positions.py) against independent references.

Fixtures in tests/fixtures/kernels/positions.npz, written by
tests/fixtures/make_positions_fixtures.py: Hugging Face ``LlamaRotaryEmbedding`` /
``PhiRotaryEmbedding`` + ``apply_rotary_pos_emb``, diffusers ``get_timestep_embedding``, T5's
``_relative_position_bucket`` and ``compute_bias``, OPT's ``OPTLearnedPositionalEmbedding``.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dist_runtime.kernels.positions as P
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir.ops import PosEmbed, RelativePosEmbedding, Rope, SinusoidalEmbed
from kernel_cases import run_kernel as run

FIXTURES = np.load(Path(__file__).parent / "fixtures" / "kernels" / "positions.npz")
F32 = np.finfo(np.float32).eps


def names(prefix):
    return sorted({k.split(".")[1] for k in FIXTURES.files if k.startswith(prefix + ".")} - {"rel"})


def get(key):
    return FIXTURES[key]


# -- Rope --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", names("rope"))
@pytest.mark.parametrize("pos_as", [np.float32, np.int64])
def test_rope_against_transformers(name, pos_as):
    x, expected = get(f"rope.{name}.x"), get(f"rope.{name}.y")  # [B, H, T, hd]
    head_dim, rope_dim, pos = (int(v) for v in get(f"rope.{name}.params"))
    op = Rope(head_dim=head_dim, rope_dim=rope_dim, base=float(get(f"rope.{name}.base")))
    tol = dict(rtol=1e-3, atol=2e-3) if x.dtype == np.float16 else dict(rtol=1e-5, atol=1e-5)
    # HF's own layout [B, H, T, hd] (n = 1 head per row) ...
    (y,) = run(op, x, np.array([pos], pos_as))
    assert y.dtype == x.dtype
    np.testing.assert_allclose(y.astype(np.float64), expected.astype(np.float64), **tol)
    # ... and the graph layout [B, T, H*hd], pos as a [] scalar.
    b, h, t, d = x.shape
    packed = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b, t, h * d)
    (y,) = run(op, packed, np.array(pos, pos_as))
    np.testing.assert_allclose(y.reshape(b, t, h, d).transpose(0, 2, 1, 3).astype(np.float64),
                               expected.astype(np.float64), **tol)


def test_rope_fixtures_cover_partial_rotary_and_far_positions():
    params = {n: tuple(get(f"rope.{n}.params")) for n in names("rope")}
    assert any(r < d for d, r, _ in params.values())  # Phi-style partial rotary
    assert min(r for _, r, _ in params.values()) == 2
    assert max(p for *_, p in params.values()) >= 4000


def test_rope_leaves_the_pass_through_dims_and_keeps_f32():
    x = np.random.default_rng(1).standard_normal((3, 2 * 10)).astype(np.float32)
    (y,) = run(Rope(head_dim=10, rope_dim=4), x, np.array([9], np.float32))
    assert y.dtype == np.float32
    heads_x, heads_y = x.reshape(3, 2, 10), y.reshape(3, 2, 10)
    np.testing.assert_array_equal(heads_y[..., 4:], heads_x[..., 4:])
    # A rotation keeps the norm of every rotated pair (i, i + r/2).
    np.testing.assert_allclose(np.hypot(heads_y[..., :2], heads_y[..., 2:4]),
                               np.hypot(heads_x[..., :2], heads_x[..., 2:4]), rtol=1e-5)


def test_rope_f64_and_bf16():
    x = np.random.default_rng(2).standard_normal((2, 8))
    (y64,) = run(Rope(head_dim=8, rope_dim=8), x, np.array([3.0]))
    (y16,) = run(Rope(head_dim=8, rope_dim=8), x.astype(ml_dtypes.bfloat16), np.array([3.0]))
    assert y64.dtype == np.float64 and y16.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(y16.astype(np.float64), y64, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("pos", [np.array([-1.0], np.float32), np.array([2.5], np.float32),
                                 np.array([1, 2], np.int64)])
def test_rope_rejects_bad_positions(pos):
    with pytest.raises(DistRuntimeError, match="Rope: pos"):
        run(Rope(head_dim=2, rope_dim=2), np.zeros((1, 2), np.float32), pos)


# -- SinusoidalEmbed ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", names("sin"))
def test_sinusoidal_against_diffusers(name):
    t, expected = get(f"sin.{name}.t"), get(f"sin.{name}.emb")
    dim, flip = (int(v) for v in get(f"sin.{name}.params"))
    max_period, shift = (float(v) for v in get(f"sin.{name}.fparams"))
    op = SinusoidalEmbed(dim=dim, max_period=max_period, flip_sin_to_cos=bool(flip),
                         downscale_freq_shift=shift)
    (emb,) = run(op, t)
    assert emb.dtype == np.float32 and emb.shape == expected.shape
    # The angle t * freq is an f32 product; one ulp of freq moves it by |t| ulps of 1, so the
    # tolerance scales with the largest timestep (a few e-4 at t ~ 1e4).
    atol = 4 * F32 * max(1.0, float(np.abs(t).max()))
    np.testing.assert_allclose(emb, expected, rtol=0, atol=atol)
    (one,) = run(op, t[0])  # a scalar timestep gives [dim]
    assert one.shape == (dim,)
    np.testing.assert_array_equal(one, emb[0])


# -- RelativePosEmbedding ----------------------------------------------------------------------
@pytest.mark.parametrize("name", names("bucket"))
def test_t5_buckets_against_transformers(name):
    buckets, distance, bidirectional = (int(v) for v in get(f"bucket.{name}.params"))
    got = P.relative_position_bucket(get("bucket.rel"), num_buckets=buckets, max_distance=distance,
                                     bidirectional=bool(bidirectional))
    np.testing.assert_array_equal(got, get(f"bucket.{name}"))


def test_t5_compute_bias_with_past_offset():
    buckets, distance, bidirectional, tq, tk, pos = (int(v) for v in get("bias.params"))
    op = RelativePosEmbedding(num_buckets=buckets, max_distance=distance,
                              bidirectional=bool(bidirectional))
    table = get("bias.table")
    q, k = np.zeros((1, tq, 12), np.float32), np.zeros((1, tk, 12), np.float32)
    (bias,) = run(op, q, k, table, np.array([pos], np.float32))
    assert bias.dtype == table.dtype
    np.testing.assert_array_equal(bias, get("bias.out"))
    (f16,) = run(op, q, k, table.astype(np.float16), np.array(pos, np.int32))
    assert f16.dtype == np.float16


def test_relative_bias_without_pos_is_a_closed_form():
    table = np.arange(32 * 2, dtype=np.float32).reshape(32, 2)
    op = RelativePosEmbedding()
    (bias,) = run(op, np.zeros((4, 1), np.float32), np.zeros((6, 1), np.int64), table)
    # |rel| < 8 is its own bucket; positive rel in the upper half (bidirectional).
    for i in range(4):
        for j in range(6):
            rel = j - i
            bucket = (16 if rel > 0 else 0) + abs(rel)
            assert list(bias[:, i, j]) == list(table[bucket])


# -- PosEmbed ----------------------------------------------------------------------------------
def test_pos_embed_against_opt():
    past, t = (int(v) for v in get("opt.params"))
    table = get("opt.table")
    (y,) = run(PosEmbed(offset=2), np.zeros((1, t, 6), np.float32), table, np.array([past], np.float32))
    np.testing.assert_array_equal(y, get("opt.out"))
    assert y.dtype == table.dtype and not np.shares_memory(y, table)


def test_pos_embed_gpt2_style_and_errors():
    table = np.arange(10 * 3, dtype=np.float16).reshape(10, 3)
    (y,) = run(PosEmbed(), np.zeros((2, 4, 3), np.float32), table)  # no pos: rows 0..3
    np.testing.assert_array_equal(y, table[:4])
    assert y.dtype == np.float16
    (y,) = run(PosEmbed(offset=1), np.zeros((1, 3), np.int64), table, np.array(8.0, np.float32))
    np.testing.assert_array_equal(y, table[9:10])
    with pytest.raises(DistRuntimeError, match=r"position 10 .*has 10 rows"):
        run(PosEmbed(offset=1), np.zeros((2, 3), np.float32), table, np.array([8.0], np.float32))


def test_cached_cos_sin_rows_are_the_computed_ones():
    """The block cache (cos_sin_rows) gives rope_cos_sin's bits: inside a block, across a block's
    end, past two blocks (computed directly), and no rows; its slices are read-only."""
    from dist_runtime.kernels.positions import ROPE_BLOCK, cos_sin_rows, rope_cos_sin

    for rope_dim, base in ((64, 10000.0), (128, 500000.0)):
        for start, length in ((0, 1), (37, 16), (ROPE_BLOCK - 3, 7), (5 * ROPE_BLOCK + 1, 1),
                              (ROPE_BLOCK - 1, 2 * ROPE_BLOCK + 5), (9, 0)):
            got, want = cos_sin_rows(start, length, rope_dim, base), rope_cos_sin(start, length, rope_dim, base)
            for g, w in zip(got, want):
                assert g.shape == w.shape == (length, rope_dim // 2)
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (start, length)
    cos, _ = cos_sin_rows(3, 2, 64, 10000.0)
    assert not cos.flags.writeable
