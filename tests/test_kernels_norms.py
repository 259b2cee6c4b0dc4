"""The normalisation kernels (kernels/norms.py) against independent references.

* PyTorch, through tests/fixtures/kernels/norms.npz (written by tests/fixtures/make_norms_fixtures.py:
  Hugging Face LlamaRMSNorm's formula, F.layer_norm, F.batch_norm, F.group_norm, F.instance_norm,
  DiT's modulate; torch computes in f64 from the exact inputs).
* Closed forms for FusedSkipNorm's ``sum`` output, empty tensors and the run-time errors.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from kernel_cases import TOLERANCES, load_cases, run_kernel as run

import dist_runtime.kernels.norms as N
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir import ops
from dist_runtime.kernels.registry import kernel_for

CASES = load_cases(Path(__file__).parent / "fixtures" / "kernels" / "norms.npz")
OPS = ["RmsNorm", "LayerNorm", "BatchNorm", "GroupNorm", "InstanceNorm", "AdaLN", "FusedSkipNorm"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_against_torch(case):
    before = [a.copy() for a in case.inputs]
    outputs = run(case.op, *case.inputs)
    if isinstance(case.op, ops.FusedSkipNorm):
        total, y = outputs
        exact_sum = case.inputs[0].astype(np.float64) + case.inputs[1].astype(np.float64)
        assert total.dtype == case.inputs[0].dtype
        np.testing.assert_allclose(total.astype(np.float64), exact_sum, **case.tolerance)
    else:
        (y,) = outputs
    assert isinstance(y, np.ndarray) and y.dtype == case.inputs[0].dtype  # f32 stays f32 (NEP 50)
    assert y.shape == case.expected.shape
    np.testing.assert_allclose(y.astype(np.float64), case.expected, **case.tolerance)
    for a, b in zip(case.inputs, before):  # kernels never write into their inputs
        np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


def test_every_op_has_cases_and_a_kernel():
    assert {type(c.op).__name__ for c in CASES} == set(OPS)
    for name in OPS:
        kernel_for(getattr(ops, name))


def test_rms_norm_is_callable_on_its_own():
    """FusedNormMatmul imports ``rms_norm(x, weight, *, eps)``: keyword eps, x's dtype out."""
    x = np.array([[3.0, 4.0]], np.float32)
    y = N.rms_norm(x, np.array([1.0, 2.0], np.float32), eps=0.0)
    np.testing.assert_allclose(y, [[3 / 12.5**0.5, 8 / 12.5**0.5]], rtol=1e-6)
    assert y.dtype == np.float32
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert N.rms_norm(x.astype(bf16), np.ones(2, np.float32), eps=1e-6).dtype == bf16


def test_fused_skip_norm_matches_add_then_rms_norm():
    rng = np.random.default_rng(3)
    x, r, w = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 16), (2, 5, 16), (16,)))
    total, normed = N.fused_skip_norm(x, r, w, eps=1e-6)
    np.testing.assert_array_equal(total, x + r)
    np.testing.assert_allclose(normed, N.rms_norm(x + r, w, eps=1e-6), **TOLERANCES["f32"])


@pytest.mark.parametrize("fn, x, params", [
    (N.layer_norm, np.zeros((0, 5), np.float32), dict(eps=1e-5)),
    (N.layer_norm, np.zeros((3, 0), np.float32), dict(eps=1e-5)),
    (N.rms_norm, np.zeros((0, 4), np.float32), dict(weight=np.ones(4, np.float32), eps=1e-6)),
    (N.group_norm, np.zeros((0, 4, 3), np.float32), dict(num_groups=2, eps=1e-5)),
    (N.group_norm, np.zeros((2, 4, 0), np.float32), dict(num_groups=2, eps=1e-5)),
    (N.instance_norm, np.zeros((2, 0, 3), np.float32), dict(eps=1e-5)),
    (N.ada_ln, np.zeros((2, 0, 4), np.float32), dict(shift=np.ones(4, np.float32), scale=np.ones(4, np.float32),
                                                      eps=1e-6)),
])
def test_empty_tensors_give_empty_results_without_warnings(fn, x, params):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "mean of empty slice"
        y = fn(x, **params)
    assert y.shape == x.shape and y.dtype == x.dtype


# -- run-time errors (dims unknown at load time) ------------------------------------------------
F32 = np.float32


@pytest.mark.parametrize("op, inputs, message", [
    (ops.RmsNorm(), [np.ones((2, 4), F32), np.ones((3,), F32)], "RmsNorm: weight has shape [3], expected [4]"),
    (ops.LayerNorm(), [np.ones((2, 4), F32), np.ones((4,), F32), np.ones((1,), F32)], "LayerNorm: bias has shape [1]"),
    (ops.BatchNorm(), [np.ones((2, 3, 4), F32)] + [np.ones((3,), F32)] * 3 + [np.ones((2,), F32)],
     "BatchNorm: var has shape [2], expected [3]"),
    (ops.GroupNorm(num_groups=4), [np.ones((1, 6, 2), F32)], "GroupNorm: num_groups=4 does not divide the 6"),
    (ops.InstanceNorm(), [np.ones((1, 3, 2), F32), np.ones((4,), F32)], "InstanceNorm: weight has shape [4]"),
    (ops.AdaLN(), [np.ones((1, 5, 8), F32), np.ones((2, 1, 8), F32), np.ones((8,), F32)],
     "AdaLN: shift [2, 1, 8] is not broadcastable to [1, 5, 8]"),
    (ops.FusedSkipNorm(), [np.ones((2, 4), F32), np.ones((3, 4), F32), np.ones((4,), F32)],
     "FusedSkipNorm: residual [3, 4] must have the shape of x [2, 4]"),
])
def test_run_time_violations_raise_a_runtime_error(op, inputs, message):
    with pytest.raises(DistRuntimeError) as err:
        run(op, *inputs)
    assert str(err.value).startswith(message)
