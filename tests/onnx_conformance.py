"""ONNX's own test cases, run through our kernels: the harness behind tests/test_onnx_conformance.py,
tests/test_op_coverage.py and scripts/onnx_conformance_table.py.

Cases:

* ONNX's node test cases (``onnx.backend.test.case.node``: onnx >= 1.23 builds them in memory) for
  every ONNX operator that has a converter in ``dist_runtime/importers/onnx/``.  Building
  runs ONNX's numpy references, ~10 s for all, so only the case modules of mapped operators are
  imported (that is the loader's filter: importing a module builds its cases), once per process.
  The ``*_expanded*`` variants are not run: they test ONNX function bodies made of other
  operators, with the same data as the case they expand.
* The on-disk ``data/pytorch-converted`` cases (Conv1d/Conv3d, 1-D and 3-D pools, and every other
  one whose operators all have converters), small graphs exported from PyTorch with initializers.
* Cases with inputs chosen here and outputs of ONNX's reference implementation
  (``onnx.reference.ReferenceEvaluator``) for what the node tests cannot reach: a real rotary
  table for RotaryEmbedding, attention windows that our SdpaWindow expresses, and edge cases
  (non-finite values, ties, empty dims, f16, unusual conv/pool geometry) (``ref_*``).

A case runs like an importer would: node by node, each ONNX node converted to our nodes (its
initializers, Constant outputs and, at the positions ``CONSTANT_INPUTS`` names, its test inputs
are constants known at conversion), our nodes run with ``kernels.kernel_for`` in order.  The
converted graph then goes through ``check_structure`` and ``infer_shapes``, whose predicted
output shapes and dtypes must match the run, and the outputs are compared as ONNX's backend
runner does: same shape and dtype, ``assert_allclose(rtol=case.rtol, atol=case.atol)`` (NaN
equal to NaN) for floats (bfloat16 with rtol at least 2**-6, as ONNX), exact for integers.

Every case that does not simply pass is listed in :data:`EXCLUDED`, with its reason.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

import dist_runtime.kernels  # noqa: F401  (registers every family module's kernels)
from dist_runtime.dtypes import DType
from dist_runtime.importers.onnx import (CONSTANT_INPUTS, CONVERTERS, TARGETS, OnnxValue, UnsupportedOnnxError,
                                         convert_node)
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import OPS_BY_NAME, OPS_BY_TAG, KvCache
from dist_runtime.ir.validate import check_structure, infer_shapes
from dist_runtime.kernels.attention import KvState
from dist_runtime.kernels.registry import KernelContext, kernel_for

for _family in ("quant", "matmul"):  # registered by kernels/__init__ once that imports them
    try:
        importlib.import_module(f"dist_runtime.kernels.{_family}")
    except ImportError:
        pass

ROOT = Path(__file__).resolve().parents[1]
OPS_MD = ROOT / "docs" / "ops.md"
MARK = "onnx-conformance"


# -- what does not simply pass ---------------------------------------------------------------------
@dataclass(frozen=True)
class Exclusion:
    """Why a case does not run (``skip``), runs as a known kernel bug (``kernel-bug``, a strict
    xfail), differs from ONNX on its data by a documented design choice the converter cannot see
    (``by-design``, a strict xfail, e.g. NaN handling), or runs with some outputs not compared
    (``partial``)."""

    reason: str
    kind: str = "skip"
    unchecked: tuple[str, ...] = ()  # partial: ONNX outputs left out of the conversion
    op: str | None = None  # our op a skipped case counts under (default: the converter's first target)


_NEAREST_34 = ("nearest, half_pixel, round_prefer_floor downsampling by 3/4: ONNX rounds half-pixel "
               "coordinates, our nearest (torch's legacy) floors asymmetric ones; they pick other pixels")
_NEAREST_MODES = ("a nearest_mode / coordinate mode (ceil + half_pixel, floor + align_corners, "
                  "round_prefer_ceil + asymmetric) that picks other pixels than our nearest (asymmetric floor)")
_INT_ARITH = "integer arithmetic: our Add/Sub/Mul/Div/Clamp compute on float types only (docs/ops.md)"
_LINEAR_TYPES = ("a 16-, 4- or 2-bit integer or float8/float4 quantized type: our linear Quantize and "
                 "Dequantize are int8/uint8 (docs/ops.md)")

#: Case name pattern (fnmatch) -> exclusion; the first match wins.  The converter must refuse a
#: ``skip`` case (UnsupportedOnnxError), else the test fails: a stale exclusion hides coverage.
EXCLUDED: dict[str, Exclusion] = {
    # arithmetic, layout
    "test_add_*int*": Exclusion(_INT_ARITH),
    "test_sub_*int*": Exclusion(_INT_ARITH),
    "test_mul_*int*": Exclusion(_INT_ARITH),
    "test_div_*int*": Exclusion(_INT_ARITH),
    "test_clip_default_int8_*": Exclusion(_INT_ARITH, op="Clamp"),
    "test_reshape_allowzero_reordered": Exclusion(
        "allowzero=1 with a 0 in the target shape: our Reshape copies the input dim for a 0"),
    # activations, reductions
    "test_argmax_*_select_last_index": Exclusion(
        "select_last_index=1: our Argmax returns the first index of the maximum"),
    "test_einsum_sum*": Exclusion("an einsum that sums over an index: we have no reduction op",
                                  op="Permute"),
    "test_einsum_batch_diagonal": Exclusion("an einsum diagonal (repeated index, ellipsis)", op="Permute"),
    # normalisation
    "test_layer_normalization_*": Exclusion(
        "Mean and InvStdDev outputs (training statistics) have no counterpart; Y is compared",
        kind="partial", unchecked=("Mean", "InvStdDev")),
    "test_batchnorm_*_training_mode": Exclusion(
        "training_mode=1 normalises with the batch's own statistics; ours is inference only"),
    # convolution, pooling
    "test_convtranspose_3d": Exclusion("3-D transposed convolution: we have ConvTranspose2d only"),
    "test_convtranspose_autopad_same": Exclusion(
        "SAME_UPPER crops only the end of the output: not a symmetric padding plus output_padding"),
    "test_maxpool_2d_uint8": Exclusion("uint8 pooling: our Pool computes on float types only"),
    "test_maxpool_with_argmax_*": Exclusion("MaxPool's Indices output has no counterpart"),
    "ref_edge_maxpool_nan_and_inf": Exclusion(
        "NaN in a max-pooling window: ours propagates it (as torch, docs/ops.md), ONNX's reference "
        "skips it", kind="by-design"),
    "test_maxpool_3d_*": Exclusion("3-D pooling: our Pool pools 1-D and 2-D only"),
    "test_averagepool_3d_*": Exclusion("3-D pooling: our Pool pools 1-D and 2-D only"),
    "test_MaxPool3d*": Exclusion("3-D pooling: our Pool pools 1-D and 2-D only"),
    "test_AvgPool3d*": Exclusion("3-D pooling: our Pool pools 1-D and 2-D only"),
    "test_maxpool_2d_same_*": Exclusion("SAME padding that is asymmetric (even kernel)"),
    "test_averagepool_2d_same_*": Exclusion("SAME padding that is asymmetric (even kernel)"),
    "test_maxpool_2d_pads": Exclusion("padding larger than half the kernel (torch's limit, ours too)"),
    "test_averagepool_2d_pads": Exclusion("padding larger than half the kernel (torch's limit, ours too)"),
    "test_averagepool_2d_pads_count_include_pad": Exclusion(
        "padding larger than half the kernel (torch's limit, ours too)"),
    "test_averagepool_2d_precomputed_pads_count_include_pad": Exclusion(
        "count_include_pad=1 with padding: our average pooling excludes the padding"),
    "test_averagepool_2d_ceil_last_window_starts_on_pad": Exclusion(
        "count_include_pad=1 with padding: our average pooling excludes the padding"),
    "test_*pool_2d_ceil": Exclusion("ceil_mode=1 adds a window floor mode does not have: our Pool "
                                    "uses floor mode"),
    "test_*pool_*dilations*": Exclusion("pooling with dilations: our Pool has no dilation"),
    "test_MaxPool*_stride_padding_dilation": Exclusion("pooling with dilations: our Pool has no dilation"),
    # resampling
    "test_resize_*_antialias": Exclusion("antialiased downsampling: our Interpolate has no antialias filter"),
    "test_resize_tf_crop_and_resize*": Exclusion("tf_crop_and_resize: a crop with extrapolation values"),
    "test_resize_downsample_scales_*_align_corners": Exclusion(
        "align_corners with a fractional output length (scale x length): ONNX divides by "
        "scale*in - 1, ours (torch) by out - 1"),
    "test_resize_*_half_pixel_symmetric": Exclusion(
        "half_pixel_symmetric with a fractional scale x length: its centring offset has no counterpart"),
    "test_resize_downsample_sizes_linear_pytorch_half_pixel": Exclusion(
        "pytorch_half_pixel with an output length of 1: ONNX samples position 0 (coordinate -0.5), "
        "ours in/2 - 0.5 (torch); the other axis needs the half-pixel mapping"),
    "test_resize_downsample_sizes_nearest": Exclusion(_NEAREST_34),
    "test_resize_downsample_sizes_nearest_not_smaller": Exclusion(_NEAREST_34),
    "test_resize_upsample_sizes_nearest_*_half_pixel": Exclusion(_NEAREST_MODES),
    "test_resize_upsample_sizes_nearest_*_align_corners": Exclusion(_NEAREST_MODES),
    "test_resize_upsample_sizes_nearest_*_asymmetric": Exclusion(_NEAREST_MODES),
    "test_resize_upsample_scales_cubic_asymmetric": Exclusion(
        "cubic with asymmetric coordinates: our bicubic samples half-pixel (or align_corners) "
        "positions, as torch"),
    "test_resize_*_cubic_A_n0p5_exclude_outside": Exclusion(
        "cubic_coeff_a=-0.5 and exclude_outside=1: our bicubic is torch's (A=-0.75, edge replicated)"),
    # quantization
    "test_quantizelinear_blocked_*": Exclusion("blocked quantization: ours is per tensor or per axis"),
    "test_dequantizelinear_blocked": Exclusion("blocked quantization: ours is per tensor or per axis"),
    "test_*quantizelinear_*int16": Exclusion(_LINEAR_TYPES),
    "test_*quantizelinear_*int4": Exclusion(_LINEAR_TYPES),
    "test_*quantizelinear_*int2": Exclusion(_LINEAR_TYPES),
    "test_*quantizelinear_e4m3fn*": Exclusion(_LINEAR_TYPES),
    "test_*quantizelinear_e5m2": Exclusion(_LINEAR_TYPES),
    "test_*quantizelinear_float4e2m1": Exclusion(_LINEAR_TYPES),
    # positions
    "test_rotary_embedding*_interleaved*": Exclusion(
        "interleaved=1 (GPT-J pairing): our Rope rotates halves (GPT-NeoX pairing)"),
    "test_rotary_embedding*": Exclusion(
        "the test's cos/sin caches are random numbers, not the rotary table of a frequency base, "
        "and its position_ids random: our Rope computes its table from `base` and takes one start "
        "position"),
    # attention
    "test_attention_*softcap*": Exclusion("softcap: our attention has no tanh soft-capping of scores"),
    "test_attention_*qk_matmul*": Exclusion("the qk_matmul_output output (scores) has no counterpart"),
    "test_attention_*diff_head*": Exclusion(
        "the value head size differs from the query/key head size: ours has one head_dim"),
    "test_attention_3d_local_window": Exclusion(
        "the value head size differs from the query/key head size: ours has one head_dim"),
    "test_attention_local_window_gqa_rank4_mask": Exclusion(
        "softcap and the qk_matmul_output output have no counterpart"),
}

def exclusion(name: str) -> Exclusion | None:
    for pattern, ex in EXCLUDED.items():
        if fnmatch.fnmatchcase(name, pattern):
            return ex
    return None


# -- loading the cases -----------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    source: str  # "node" or "pytorch-converted"
    model: onnx.ModelProto
    inputs: dict[str, np.ndarray]  # graph inputs that are not initializers
    outputs: dict[str, np.ndarray]  # expected, by graph output name
    rtol: float
    atol: float

    @property
    def opset(self) -> int:
        return next(o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx"))

    @property
    def op_types(self) -> list[str]:
        return [n.op_type for n in self.model.graph.node if n.op_type != "Constant"]


def _array(value) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


_MODULE = {"InstanceNormalization": "instance_normalization", "BatchNormalization": "batch_normalization",
           "CausalConvWithState": "causal_conv_with_state"}


@functools.cache
def node_cases() -> tuple[Case, ...]:
    """ONNX's node test cases of the mapped operators (the modules of other operators are never
    imported, so their cases are never built)."""
    import onnx.backend.test.case.node as node_tests

    for op_type in sorted(CONVERTERS):
        module = _MODULE.get(op_type, op_type.lower())
        try:
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
        except ModuleNotFoundError:
            continue  # no node tests for this operator
    cases = []
    for tc in node_tests._NodeTestCases:
        if "_expanded" in tc.name or len(tc.model.graph.node) != 1:
            continue
        if tc.model.graph.node[0].op_type not in CONVERTERS:
            continue
        graph = tc.model.graph
        (ins, outs), = tc.data_sets
        cases.append(Case(tc.name, "node", tc.model,
                          {v.name: _array(a) for v, a in zip(graph.input, ins)},
                          {v.name: _array(a) for v, a in zip(graph.output, outs)}, tc.rtol, tc.atol))
    return tuple(cases)


def _load_tensor(path: str) -> np.ndarray:
    tensor = onnx.TensorProto()
    with open(path, "rb") as f:
        tensor.ParseFromString(f.read())
    return numpy_helper.to_array(tensor)


@functools.cache
def pytorch_cases() -> tuple[Case, ...]:
    """The ``pytorch-converted`` cases whose operators all have converters."""
    from onnx.backend.test.loader import load_model_tests

    cases = []
    for tc in sorted(load_model_tests(kind="pytorch-converted"), key=lambda t: t.name):
        model = onnx.load(os.path.join(tc.model_dir, "model.onnx"))
        if not all(n.op_type in CONVERTERS or n.op_type == "Constant" for n in model.graph.node):
            continue
        data = os.path.join(tc.model_dir, "test_data_set_0")
        inits = {i.name for i in model.graph.initializer}
        feeds = [v.name for v in model.graph.input if v.name not in inits]
        ins = {name: _load_tensor(os.path.join(data, f"input_{i}.pb")) for i, name in enumerate(feeds)}
        outs = {v.name: _load_tensor(os.path.join(data, f"output_{i}.pb"))
                for i, v in enumerate(model.graph.output)}
        cases.append(Case(tc.name, "pytorch-converted", model, ins, outs, tc.rtol, tc.atol))
    return tuple(cases)


def _rope_caches(positions: int, rope_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """A rotary table as Hugging Face computes it (f32): cos/sin(p * base^(-2i/r)), [positions, r/2]."""
    exponent = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    inv_freq = np.float32(1.0) / np.float32(base) ** exponent
    theta = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(theta), np.sin(theta)


def _reference_case(name: str, node: onnx.NodeProto, opset: int, inputs: dict[str, np.ndarray]) -> Case:
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    def model_of(arrays):
        graph = helper.make_graph(
            [node], name,
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
             for n, a in arrays.items()],
            [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output if o])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    model = model_of(inputs)
    with np.errstate(all="ignore"):
        outs = ReferenceEvaluator(model).run(None, inputs)
    atol = 1e-7
    if any(a.dtype == np.float16 for a in inputs.values()):
        # The reference computes f16 in f16 (several ulps off); ours computes in f32 and rounds
        # once.  The oracle is then the reference run in f64 on the same values, rounded to f16,
        # within ONNX's rtol and one f16 ulp at magnitude 1 (intermediates our compositions round).
        wide = {n: a.astype(np.float64) if a.dtype == np.float16 else a for n, a in inputs.items()}
        with np.errstate(all="ignore"):
            outs = [w.astype(o.dtype) for w, o in zip(ReferenceEvaluator(model_of(wide)).run(None, wide), outs)]
        atol = 2.0**-10
    expected = dict(zip([o for o in node.output if o], outs))
    return Case(name, "onnx-reference", model, inputs, expected, 1e-3, atol)


@functools.cache
def reference_cases() -> tuple[Case, ...]:
    """Cases whose expected outputs come from ONNX's reference implementation
    (``onnx.reference.ReferenceEvaluator``) on inputs chosen here, for what ONNX's node tests
    cannot reach: RotaryEmbedding with a real rotary table (the node tests use random caches), and
    Attention windows that line up with our SdpaWindow (the node tests' windows are top-left
    aligned with Tq < Tk, which only an explicit mask expresses)."""
    from onnx import helper

    rng = np.random.default_rng(23)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = []
    rope = [  # name, x shape, attributes, rope_dim, base, start position (None: no position_ids)
        ("ref_rotary_embedding_4d_base1e4_pos3", (2, 3, 5, 8), {}, 8, 10000.0, 3),
        ("ref_rotary_embedding_3d_partial_base5e5", (2, 5, 32), {"num_heads": 4, "rotary_embedding_dim": 4},
         4, 500000.0, 0),
        ("ref_rotary_embedding_4d_long_positions", (1, 2, 4, 16), {}, 16, 10000.0, 1000),
        ("ref_rotary_embedding_no_position_ids", (2, 2, 6, 8), {}, 8, 10000.0, None),
    ]
    for name, shape, attrs, rope_dim, base, start in rope:
        seq = shape[-2] if len(shape) == 4 else shape[1]
        batch = shape[0]
        inputs = {"x": rand(*shape)}
        if start is None:
            cos, sin = _rope_caches(seq, rope_dim, base)
            inputs["cos_cache"], inputs["sin_cache"] = np.stack([cos] * batch), np.stack([sin] * batch)
            names = ["x", "cos_cache", "sin_cache"]
        else:
            cos, sin = _rope_caches(start + seq + 7, rope_dim, base)
            inputs["cos_cache"], inputs["sin_cache"] = cos, sin
            inputs["position_ids"] = np.tile(np.arange(start, start + seq, dtype=np.int64), (batch, 1))
            names = ["x", "cos_cache", "sin_cache", "position_ids"]
        node = helper.make_node("RotaryEmbedding", names, ["y"], **attrs)
        out.append(_reference_case(name, node, 23, inputs))

    attention = [  # name, attributes, Q, K, V (, past_key, past_value) shapes
        ("ref_attention_4d_causal_square", {"is_causal": 1}, (2, 3, 5, 8), (2, 3, 5, 8), None),
        ("ref_attention_4d_causal_window", {"is_causal": 1, "left_window_size": 2}, (1, 2, 6, 8), (1, 2, 6, 8),
         None),
        ("ref_attention_4d_band", {"left_window_size": 1, "right_window_size": 1}, (1, 2, 6, 8), (1, 2, 6, 8),
         None),
        ("ref_attention_3d_gqa_causal_window_with_past",
         {"is_causal": 1, "left_window_size": 2, "q_num_heads": 2, "kv_num_heads": 1},
         (1, 3, 16), (1, 3, 8), (1, 1, 4, 8)),
    ]
    for name, attrs, q, k, past in attention:
        inputs = {"Q": rand(*q), "K": rand(*k), "V": rand(*k)}
        names, outs = ["Q", "K", "V"], ["Y"]
        if past:
            inputs["past_key"], inputs["past_value"] = rand(*past), rand(*past)
            names += ["", "past_key", "past_value"]
            outs += ["present_key", "present_value"]
        node = helper.make_node("Attention", names, outs, **attrs)
        out.append(_reference_case(name, node, 25, inputs))
    out.extend(_edge_cases(rand))
    return tuple(out)


def _edge_cases(rand) -> list[Case]:
    """Edge cases (non-finite values, ties, empty dims, unusual geometry, f16/bf16) of mapped
    operators, with ONNX's reference implementation as the oracle."""
    from onnx import helper

    inf, nan = np.float32(np.inf), np.float32(np.nan)
    mk = helper.make_node
    x35 = rand(3, 5)
    special = np.array([[0.0, -inf, 1.0, inf, nan], [-30.0, 30.0, -1e-30, 1e30, -1e30]], np.float32)
    img = rand(2, 4, 7, 6)
    edge = [
        ("softmax_neg_inf", mk("Softmax", ["x"], ["y"], axis=-1), 13,
         {"x": np.array([[0.0, -inf, 1.0], [-inf, -inf, -inf], [1e30, 1e30, -1e30]], np.float32)}),
        ("softmax_f16_axis0", mk("Softmax", ["x"], ["y"], axis=0), 13, {"x": rand(4, 3).astype(np.float16)}),
        ("relu_special", mk("Relu", ["x"], ["y"]), 14, {"x": special}),
        ("leakyrelu_special", mk("LeakyRelu", ["x"], ["y"], alpha=0.3), 16, {"x": special}),
        ("sigmoid_special", mk("Sigmoid", ["x"], ["y"]), 13, {"x": special}),
        ("tanh_special", mk("Tanh", ["x"], ["y"]), 13, {"x": special}),
        ("gelu_special", mk("Gelu", ["x"], ["y"]), 20, {"x": special}),
        ("gelu_tanh_special", mk("Gelu", ["x"], ["y"], approximate="tanh"), 20, {"x": special}),
        ("clip_nan_and_inf", mk("Clip", ["x", "lo", "hi"], ["y"]), 13,
         {"x": special, "lo": np.array(-1.0, np.float32), "hi": np.array(2.0, np.float32)}),
        ("div_by_zero", mk("Div", ["a", "b"], ["y"]), 14,
         {"a": np.array([1.0, -1.0, 0.0, 2.0], np.float32), "b": np.array([0.0, 0.0, 0.0, -0.0], np.float32)}),
        ("add_f16_bcast", mk("Add", ["a", "b"], ["y"]), 14,
         {"a": rand(2, 3, 4).astype(np.float16), "b": rand(4).astype(np.float16)}),
        ("mul_f64_scalar", mk("Mul", ["a", "b"], ["y"]), 14, {"a": rand(3, 2).astype(np.float64),
                                                             "b": np.array(3.5, np.float64)}),
        ("matmul_empty_k", mk("MatMul", ["a", "b"], ["y"]), 13,
         {"a": np.zeros((3, 0), np.float32), "b": np.zeros((0, 4), np.float32)}),
        ("matmul_batched_bcast_f16", mk("MatMul", ["a", "b"], ["y"]), 13,
         {"a": rand(2, 1, 3, 8).astype(np.float16), "b": rand(4, 8, 5).astype(np.float16)}),
        ("argmax_ties_and_nan", mk("ArgMax", ["x"], ["y"], axis=1, keepdims=0), 13,
         {"x": np.array([[1.0, 3.0, 3.0, 0.0], [2.0, nan, 5.0, nan], [-inf, -inf, -inf, -inf]], np.float32)}),
        ("argmax_axis0_keepdims", mk("ArgMax", ["x"], ["y"], axis=0, keepdims=1), 13, {"x": rand(4, 3, 2)}),
        ("layernorm_d1", mk("LayerNormalization", ["x", "w", "b"], ["y"], epsilon=1e-5), 17,
         {"x": rand(3, 1), "w": rand(1), "b": rand(1)}),
        ("layernorm_f16", mk("LayerNormalization", ["x", "w", "b"], ["y"]), 17,
         {"x": (rand(2, 3, 16) * 4 + 3).astype(np.float16), "w": rand(16).astype(np.float16),
          "b": rand(16).astype(np.float16)}),
        ("rmsnorm_f16_axis1", mk("RMSNormalization", ["x", "w"], ["y"], axis=1), 23,
         {"x": rand(2, 3, 8).astype(np.float16), "w": rand(3, 8).astype(np.float16)}),
        ("groupnorm_one_group", mk("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=1), 21,
         {"x": rand(2, 4, 3, 3), "s": rand(4), "b": rand(4)}),
        ("groupnorm_group_per_channel_1d", mk("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=4), 21,
         {"x": rand(2, 4, 5), "s": rand(4), "b": rand(4)}),
        ("instancenorm_spatial_size_1", mk("InstanceNormalization", ["x", "s", "b"], ["y"]), 22,
         {"x": rand(2, 3, 1, 1), "s": rand(3), "b": rand(3)}),
        ("batchnorm_rank2", mk("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3), 15,
         {"x": rand(4, 3), "s": rand(3), "b": rand(3), "m": rand(3), "v": np.abs(rand(3)) + 0.1}),
        ("prelu_channel_slope", mk("PRelu", ["x", "s"], ["y"]), 16, {"x": img, "s": rand(4, 1, 1)}),
        ("conv2d_groups_dilation_stride_pads_bias",
         mk("Conv", ["x", "w", "b"], ["y"], group=2, dilations=[2, 1], strides=[2, 3], pads=[2, 1, 2, 1]), 22,
         {"x": img, "w": rand(6, 2, 3, 2), "b": rand(6)}),
        ("conv1d_dilation_stride_pads", mk("Conv", ["x", "w"], ["y"], dilations=[3], strides=[2], pads=[2, 2]),
         22, {"x": rand(2, 3, 11), "w": rand(4, 3, 3)}),
        ("conv3d_groups_f64", mk("Conv", ["x", "w", "b"], ["y"], group=2, pads=[1, 0, 1, 1, 0, 1]), 22,
         {"x": rand(1, 4, 3, 4, 5).astype(np.float64), "w": rand(2, 2, 2, 3, 3).astype(np.float64),
          "b": rand(2).astype(np.float64)}),
        ("conv_depthwise_multiplier", mk("Conv", ["x", "w"], ["y"], group=4, pads=[1, 1, 1, 1]), 22,
         {"x": img, "w": rand(8, 1, 3, 3)}),
        ("convtranspose_dilation_pads_output_padding",
         mk("ConvTranspose", ["x", "w", "b"], ["y"], dilations=[2, 1], strides=[2, 3], pads=[1, 1, 1, 1],
            output_padding=[1, 2]), 22, {"x": rand(2, 4, 3, 4), "w": rand(4, 3, 3, 2), "b": rand(3)}),
        ("maxpool_nan_and_inf", mk("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[1, 1]), 22,
         {"x": np.array([[[[1.0, nan, 2.0], [-inf, 0.0, inf], [3.0, 4.0, -inf]]]], np.float32)}),
        ("maxpool_2d_pads_strides", mk("MaxPool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 2],
                                       pads=[1, 1, 1, 1]), 22, {"x": img}),
        ("averagepool_1d_pads_exclude", mk("AveragePool", ["x"], ["y"], kernel_shape=[3], strides=[2],
                                           pads=[1, 1]), 22, {"x": rand(2, 3, 8)}),
        ("averagepool_2d_pads_exclude_f16",
         mk("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 1], pads=[1, 1, 1, 1]), 22,
         {"x": img.astype(np.float16)}),
        ("globalaveragepool_1d", mk("GlobalAveragePool", ["x"], ["y"]), 22, {"x": rand(2, 3, 9)}),
        ("resize_linear_align_corners_sizes", mk("Resize", ["x", "", "", "sizes"], ["y"], mode="linear",
                                                 coordinate_transformation_mode="align_corners"), 19,
         {"x": img, "sizes": np.array([2, 4, 11, 3], np.int64)}),
        ("resize_cubic_half_pixel_down", mk("Resize", ["x", "", "", "sizes"], ["y"], mode="cubic"), 19,
         {"x": img, "sizes": np.array([2, 4, 4, 5], np.int64)}),
        ("resize_linear_half_pixel_up_scales", mk("Resize", ["x", "", "scales"], ["y"], mode="linear"), 19,
         {"x": img, "scales": np.array([1, 1, 2.5, 1.5], np.float32)}),
        ("resize_nearest_asymmetric_floor_x3", mk("Resize", ["x", "", "scales"], ["y"], mode="nearest",
                                                  coordinate_transformation_mode="asymmetric",
                                                  nearest_mode="floor"),
         19, {"x": img, "scales": np.array([1, 1, 3, 3], np.float32)}),
        ("depthtospace_crd_r3", mk("DepthToSpace", ["x"], ["y"], blocksize=3, mode="CRD"), 13,
         {"x": rand(1, 18, 2, 3)}),
        ("depthtospace_dcr_r3", mk("DepthToSpace", ["x"], ["y"], blocksize=3), 13, {"x": rand(2, 18, 2, 3)}),
        ("spacetodepth_r3", mk("SpaceToDepth", ["x"], ["y"], blocksize=3), 13, {"x": rand(2, 2, 6, 9)}),
        ("gather_scalar_index", mk("Gather", ["x", "i"], ["y"], axis=1), 13,
         {"x": rand(3, 5, 2), "i": np.array(-2, np.int64)}),
        ("gather_2d_indices_last_axis", mk("Gather", ["x", "i"], ["y"], axis=2), 13,
         {"x": rand(3, 2, 5), "i": np.array([[0, 4], [4, 1], [2, 2]], np.int32)}),
        ("split_zero_piece", mk("Split", ["x", "s"], ["a", "b", "c"], axis=1), 18,
         {"x": rand(2, 5), "s": np.array([2, 0, 3], np.int64)}),
        ("concat_empty_input", mk("Concat", ["a", "b", "c"], ["y"], axis=0), 13,
         {"a": rand(2, 3), "b": np.zeros((0, 3), np.float32), "c": rand(1, 3)}),
        ("transpose_4d", mk("Transpose", ["x"], ["y"], perm=[2, 0, 3, 1]), 21, {"x": rand(2, 3, 4, 5)}),
        ("reshape_zero_and_minus_one", mk("Reshape", ["x", "s"], ["y"]), 21,
         {"x": rand(2, 3, 4), "s": np.array([0, -1, 2], np.int64)}),
        ("quantizelinear_ties_and_saturation", mk("QuantizeLinear", ["x", "s", "z"], ["y"]), 21,
         {"x": np.array([2.5, 3.5, -2.5, -3.5, 300.0, -300.0, 0.5, 1e9], np.float32),
          "s": np.array(1.0, np.float32), "z": np.array(-3, np.int8)}),
        ("quantizelinear_per_axis0_uint8", mk("QuantizeLinear", ["x", "s", "z"], ["y"], axis=0), 21,
         {"x": rand(3, 4) * 10, "s": np.array([0.5, 0.1, 2.0], np.float32),
          "z": np.array([0, 128, 255], np.uint8)}),
        ("dequantizelinear_per_axis_int8", mk("DequantizeLinear", ["x", "s", "z"], ["y"], axis=-1), 21,
         {"x": np.array([[-128, 0, 127], [5, -5, 1]], np.int8), "s": np.array([0.5, 0.25, 2.0], np.float32),
          "z": np.array([1, -2, 0], np.int8)}),
        ("attention_fully_masked_row_float", mk("Attention", ["Q", "K", "V", "m"], ["Y"]), 23,
         {"Q": rand(1, 2, 3, 4), "K": rand(1, 2, 5, 4), "V": rand(1, 2, 5, 4),
          "m": np.where(np.array([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], bool), 0.0,
                        -np.inf).astype(np.float32)}),
        ("attention_gqa_scale_f16", mk("Attention", ["Q", "K", "V"], ["Y"], scale=0.3), 23,
         {"Q": rand(2, 4, 3, 8).astype(np.float16), "K": rand(2, 2, 3, 8).astype(np.float16),
          "V": rand(2, 2, 3, 8).astype(np.float16)}),
        ("attention_3d_causal_past_decode", mk("Attention", ["Q", "K", "V", "", "pk", "pv"], ["Y", "k", "v"],
                                               is_causal=1, q_num_heads=4, kv_num_heads=2), 23,
         {"Q": rand(1, 1, 32), "K": rand(1, 1, 16), "V": rand(1, 1, 16), "pk": rand(1, 2, 6, 8),
          "pv": rand(1, 2, 6, 8)}),
        ("swish_alpha", mk("Swish", ["x"], ["y"], alpha=0.5), 24, {"x": x35}),
        ("swiglu_alpha", mk("SwiGLU", ["a", "b"], ["y"], alpha=1.702), 28, {"a": x35, "b": rand(3, 5)}),
        ("gemm_trans_b_alpha_beta_vector_c", mk("Gemm", ["a", "b", "c"], ["y"], transB=1, alpha=2.0, beta=0.5),
         13, {"a": rand(3, 4), "b": rand(5, 4), "c": rand(5)}),
    ]
    return [_reference_case(f"ref_edge_{name}", node, opset, inputs) for name, node, opset, inputs in edge]


@functools.cache
def cases() -> dict[str, Case]:
    found: dict[str, Case] = {}
    for case in node_cases() + pytorch_cases() + reference_cases():
        if case.name in found:
            raise AssertionError(f"two cases are named {case.name}")
        found[case.name] = case
    return found


# -- running a case --------------------------------------------------------------------------------
@dataclass
class Run:
    graph: Graph  # the converted graph, weights = initializers and converter constants
    values: dict[str, np.ndarray]  # every tensor, by name
    outputs: list[str]  # the compared ONNX outputs
    targets: set[str] = field(default_factory=set)  # our ops exercised (TARGETS of each ONNX node)


def _spec(array: np.ndarray) -> TensorSpec:
    return TensorSpec(tuple(array.shape), DType.from_numpy(array.dtype))


def run_case(case: Case, unchecked: tuple[str, ...] = ()) -> Run:
    """Convert ``case`` node by node and run our kernels; ``UnsupportedOnnxError`` if a node does not
    convert.  ``unchecked`` ONNX outputs are removed from the nodes before conversion."""
    graph = case.model.graph
    opset = case.opset
    values: dict[str, np.ndarray] = dict(case.inputs)
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    values.update(constants)
    nodes: list[Node] = []
    weights: dict[str, np.ndarray] = dict(constants)
    targets: set[str] = set()
    for proto in graph.node:
        if proto.op_type == "Constant":
            (attr,) = proto.attribute
            if attr.name != "value":
                raise UnsupportedOnnxError("Constant", f"a {attr.name} constant")
            values[proto.output[0]] = constants[proto.output[0]] = numpy_helper.to_array(attr.t)
            continue
        if unchecked:
            proto = onnx.NodeProto.FromString(proto.SerializeToString())
            for i, out in enumerate(proto.output):
                if out in unchecked:
                    proto.output[i] = ""
        fold = CONSTANT_INPUTS.get(proto.op_type, ())
        infos = []
        for i, name in enumerate(proto.input):
            if not name:
                infos.append(None)
                continue
            known = name in constants or (i in fold and name in case.inputs)
            infos.append(OnnxValue.of(name, values[name], constant=known))
        converted = convert_node(proto, opset, infos)
        targets |= {type(n.op).__name__ for n in converted.nodes} & set(TARGETS[proto.op_type])
        values.update(converted.constants)
        weights.update(converted.constants)
        primed = {p.node: p for p in converted.kv_caches}
        for i, node in enumerate(converted.nodes):
            ctx = KernelContext()
            if isinstance(node.op, KvCache):
                ctx.state = KvState.for_op(node.op)
                if i in primed:
                    past_k, past_v = values[primed[i].past_key], values[primed[i].past_value]
                    ctx.state.write(0, past_k, past_v)
                    ctx.pos = past_k.shape[-2]
            with np.errstate(all="ignore"):  # IEEE inf/NaN arithmetic of the edge cases is intended
                outs = kernel_for(type(node.op))(node.op, [values[n] for n in node.inputs], ctx)
            if len(outs) != len(node.outputs):
                raise AssertionError(f"{node.op_name} returned {len(outs)} outputs for "
                                     f"{len(node.outputs)} names")
            values.update(zip(node.outputs, (np.asarray(o) for o in outs)))
            nodes.append(Node(len(nodes), node.op, node.inputs, node.outputs))
    outputs = [v.name for v in graph.output if v.name not in unchecked]
    used = {n for node in nodes for n in node.inputs}
    ours = Graph(nodes, [], outputs, {n: _spec(a) for n, a in weights.items() if n in used})
    ours.inputs = [_spec(values[n]) for n in ours.input_names]
    return Run(ours, values, outputs, targets)


def check_case(case: Case, unchecked: tuple[str, ...] = ()) -> Run:
    """Run ``case`` and assert that shape inference and every compared output agree with ONNX."""
    run = run_case(case, unchecked)
    check_structure(run.graph)
    check_outputs(case, run.graph, {name: run.values[name] for name in run.outputs})
    return run


def check_outputs(case: Case, graph: Graph, actual: dict[str, np.ndarray]) -> None:
    """Assert that ``actual`` (by ONNX output name) agrees with the shapes and dtypes our shape
    rules predict for ``graph`` and with ONNX's expected outputs."""
    specs = infer_shapes(graph)
    for name, got in actual.items():
        expected = case.outputs[name]
        spec = specs[name]
        predicted = spec.shape
        assert len(predicted) == got.ndim and all(p in (-1, a) for p, a in zip(predicted, got.shape)), (
            f"{name}: shape rules predict {list(predicted)}, the kernels made {list(got.shape)}")
        assert spec.dtype == DType.from_numpy(got.dtype), (
            f"{name}: shape rules predict {spec.dtype.name}, the kernels made {got.dtype}")
        assert got.shape == expected.shape, f"{name}: shape {got.shape}, ONNX expects {expected.shape}"
        assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype}, ONNX expects {expected.dtype}"
        if expected.dtype.kind == "f" or expected.dtype.name == "bfloat16":
            rtol = case.rtol
            if expected.dtype.name == "bfloat16":
                rtol = max(rtol, 2.0**-6)
                got, expected = got.astype(np.float32), expected.astype(np.float32)
            np.testing.assert_allclose(got, expected, rtol=rtol, atol=case.atol, equal_nan=True,
                                       err_msg=f"output {name} of {case.name}")
        else:
            np.testing.assert_array_equal(got, expected, err_msg=f"output {name} of {case.name}")


# -- a case as a whole model through the importer and the executor ---------------------------------
def as_model(case: Case, unchecked: tuple[str, ...] = ()) -> onnx.ModelProto:
    """``case.model`` as an importer sees a deployed model: the test inputs at the positions
    ``CONSTANT_INPUTS`` names are initializers (the harness passes them as constants too), and the
    ``unchecked`` outputs are not requested."""
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    graph = model.graph
    fixed = {name for node in graph.node for i, name in enumerate(node.input)
             if i in CONSTANT_INPUTS.get(node.op_type, ()) and name in case.inputs}
    graph.initializer.extend(numpy_helper.from_array(case.inputs[n], n) for n in sorted(fixed))
    keep = [v for v in graph.input if v.name not in fixed]
    del graph.input[:]
    graph.input.extend(keep)
    for node in graph.node:
        for i, out in enumerate(node.output):
            if out in unchecked:
                node.output[i] = ""
    outputs = [v for v in graph.output if v.name not in unchecked]
    del graph.output[:]
    graph.output.extend(outputs)
    return model


def check_imported(case: Case, unchecked: tuple[str, ...] = ()):
    """Import ``case`` as a whole ONNX model (``importers.onnx.model``), run it with the
    GraphExecutor and compare its outputs as :func:`check_case` does.  Returns the Imported."""
    from dist_runtime.executor import GraphExecutor
    from dist_runtime.importers.onnx.model import load

    imported = load(as_model(case, unchecked))
    executor = GraphExecutor((imported.graph, imported.weights))
    session = executor.session()
    for primed in imported.config.kv_caches:  # ONNX past_key/past_value: the session's cache
        node = imported.graph.nodes[primed.node]
        step = next(i for i, n in enumerate(executor.graph.nodes) if n.outputs == node.outputs)
        past_k, past_v = case.inputs[primed.past_key], case.inputs[primed.past_value]
        state = session.kv[step] = KvState.for_op(node.op)
        state.write(0, past_k, past_v)
        session.pos = past_k.shape[-2]
    feeds = {n: case.inputs[n] for n in imported.graph.input_names}
    with np.errstate(all="ignore"):  # IEEE inf/NaN arithmetic of the edge cases is intended
        outputs = executor.run(feeds)
    check_outputs(case, imported.graph, outputs)
    return imported


# -- every case at once: the table and the coverage test -------------------------------------------
@dataclass(frozen=True)
class Outcome:
    status: str  # "passed", "failed", "excluded" (skip, by-design), "kernel-bug" (failed as recorded)
    ops: frozenset[str]  # our ops the case counts under
    onnx_ops: frozenset[str]
    reason: str = ""


@functools.cache
def outcomes() -> dict[str, Outcome]:
    result = {}
    for name, case in cases().items():
        ex = exclusion(name)
        onnx_ops = frozenset(case.op_types)
        try:
            run = check_case(case, ex.unchecked if ex and ex.kind == "partial" else ())
        except UnsupportedOnnxError as e:
            op = (ex.op if ex and ex.op else None) or TARGETS.get(e.op_type, ("?",))[0]
            if ex and ex.kind == "skip":
                result[name] = Outcome("excluded", frozenset({op}), onnx_ops, ex.reason)
            else:
                result[name] = Outcome("failed", frozenset({op}), onnx_ops, f"not in EXCLUDED: {e}")
            continue
        except Exception as e:  # noqa: BLE001  (a mismatch or a kernel error)
            ops = _targets_of(case)
            if ex and ex.kind == "kernel-bug":
                result[name] = Outcome("kernel-bug", ops, onnx_ops, ex.reason)
            elif ex and ex.kind == "by-design":
                result[name] = Outcome("excluded", ops, onnx_ops, ex.reason)
            else:
                result[name] = Outcome("failed", ops, onnx_ops, f"{type(e).__name__}: {e}")
            continue
        if ex and ex.kind != "partial":
            result[name] = Outcome("failed", frozenset(run.targets), onnx_ops,
                                   f"listed in EXCLUDED ({ex.kind}) but passes: {ex.reason}")
        else:
            result[name] = Outcome("passed", frozenset(run.targets), onnx_ops, ex.reason if ex else "")
    return result


def _targets_of(case: Case) -> frozenset[str]:
    try:
        return frozenset(run_case(case).targets)
    except Exception:  # noqa: BLE001
        return frozenset(TARGETS.get(t, ("?",))[0] for t in case.op_types)


# -- tests of ours that mention an op --------------------------------------------------------------
@functools.cache
def kernel_test_mentions() -> dict[str, list[str]]:
    """Op name -> the tests/test_kernels_*.py files that use it (``Op(`` in the source, or a case of
    a fixture npz the file loads)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "tests").glob("test_kernels_*.py")):
        text = path.read_text(encoding="utf-8")
        names = set(re.findall(r"\b([A-Z]\w*)\(", text))
        for npz in set(re.findall(r"[\"'](\w+)\.npz[\"']", text)):
            fixture = ROOT / "tests" / "fixtures" / "kernels" / f"{npz}.npz"
            if fixture.exists():
                with np.load(fixture) as z:
                    for key in z.files:
                        if key.endswith("/meta"):
                            names.add(json.loads(str(z[key]))["op"])
        rel = path.relative_to(ROOT).as_posix()
        for name in names & set(OPS_BY_NAME):
            found[name].append(rel)
    return dict(found)


# -- the table in docs/ops.md ----------------------------------------------------------------------
def render_table(results: dict[str, Outcome]) -> str:
    per_op: dict[str, list[tuple[str, Outcome]]] = defaultdict(list)
    for name, outcome in results.items():
        for op in outcome.ops:
            per_op[op].append((name, outcome))
    mentions = kernel_test_mentions()
    rows = ["| our op | ONNX operator(s) | cases run | passed | excluded | notes |",
            "|---|---|---|---|---|---|"]
    for _, spec in sorted(OPS_BY_TAG.items()):
        entries = per_op.get(spec.name, [])
        if not entries:
            files = ", ".join(f"`{f}`" for f in mentions.get(spec.name, [])) or "none"
            mapped = sorted(o for o, targets in TARGETS.items() if spec.name in targets)
            why = f"no case reaches it through {', '.join(mapped)}" if mapped else "no ONNX operator maps to it"
            rows.append(f"| {spec.name} | — | 0 | 0 | 0 | {why}; kernel tests: {files} |")
            continue
        onnx_ops = sorted({o for _, out in entries for o in out.onnx_ops if spec.name in TARGETS.get(o, ())})
        run = [o for _, o in entries if o.status in ("passed", "failed", "kernel-bug")]
        passed = [o for _, o in entries if o.status == "passed"]
        excluded = [o for _, o in entries if o.status == "excluded"]
        notes = defaultdict(int)
        for _, o in entries:
            if o.status != "passed" or o.reason:
                label = {"excluded": "", "kernel-bug": "", "failed": "FAILING: "}.get(o.status, "")
                notes[label + (o.reason if o.status != "passed" else f"partial: {o.reason}")] += 1
        text = "; ".join(f"{n} × {r}" for r, n in sorted(notes.items(), key=lambda kv: (-kv[1], kv[0])))
        rows.append(f"| {spec.name} | {', '.join(onnx_ops)} | {len(run)} | {len(passed)} | {len(excluded)} | "
                    f"{text.replace('|', '/')} |")
    statuses = defaultdict(int)
    for o in results.values():
        statuses[o.status] += 1
    sources = defaultdict(int)
    for name in results:
        sources[cases()[name].source] += 1
    total = (f"{len(results)} cases ({sources['node']} ONNX node tests, {sources['pytorch-converted']} "
             f"pytorch-converted models, {sources['onnx-reference']} with outputs of ONNX's reference "
             f"implementation): {statuses['passed']} passed, {statuses['kernel-bug']} known kernel bugs "
             f"(xfail), {statuses['excluded']} excluded, {statuses['failed']} failing.")
    return "\n".join(rows) + "\n\n" + total


def table_in_docs() -> str:
    text = OPS_MD.read_text(encoding="utf-8")
    m = re.search(rf"<!-- BEGIN GENERATED: {MARK} -->\n(.*?)<!-- END GENERATED: {MARK} -->", text, re.S)
    if not m:
        raise AssertionError(f"docs/ops.md has no {MARK} markers")
    return m.group(1).removesuffix("\n")


def write_table(body: str) -> bool:
    """Rewrite the generated block of docs/ops.md; True if it changed."""
    text = OPS_MD.read_text(encoding="utf-8")
    pattern = re.compile(rf"(<!-- BEGIN GENERATED: {MARK} -->\n).*?(<!-- END GENERATED: {MARK} -->)", re.S)
    if not pattern.search(text):
        raise AssertionError(f"docs/ops.md has no {MARK} markers")
    new = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    if new != text:
        OPS_MD.write_text(new, encoding="utf-8")
    return new != text
