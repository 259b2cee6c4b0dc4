"""Conformance against references no one here wrote: ONNX's node test cases (and the
pytorch-converted models for Conv1d/Conv3d and 1-D/3-D pools) through our converters and kernels.

One test per case (tests/onnx_conformance.py has the harness).  A case that our ops cannot express
is skipped with the reason listed in ``EXCLUDED``, and only if the converter really refuses it; a
known kernel bug runs as a strict xfail whose reason starts with "KERNEL BUG:".  The table in
docs/ops.md ("ONNX conformance") is generated from the same run.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import onnx
import pytest
from onnx import helper

import onnx_conformance as oc
from dist_runtime.errors import DistRuntimeError
from dist_runtime.importers.onnx import CONVERTERS, OnnxValue, UnsupportedOnnxError, convert_node

NAMES = sorted(oc.cases())


@pytest.mark.parametrize("name", NAMES)
def test_onnx_case(name, request):
    case = oc.cases()[name]
    ex = oc.exclusion(name)
    if ex is not None and ex.kind == "skip":
        try:
            oc.run_case(case)
        except UnsupportedOnnxError as e:
            pytest.skip(f"{ex.reason} [{e}]")
        pytest.fail(f"{name} is excluded ({ex.reason}) but converts now: remove it from EXCLUDED")
    if ex is not None and ex.kind == "kernel-bug":
        request.applymarker(pytest.mark.xfail(reason=ex.reason, strict=True))
    if ex is not None and ex.kind == "by-design":  # a mismatch, not an error
        request.applymarker(pytest.mark.xfail(reason=ex.reason, strict=True, raises=AssertionError))
    try:
        oc.check_case(case, ex.unchecked if ex is not None and ex.kind == "partial" else ())
    except UnsupportedOnnxError as e:
        pytest.fail(f"the converter refuses {name}, which EXCLUDED does not list: {e}")


def test_every_exclusion_names_a_case_and_a_reason():
    for pattern, ex in oc.EXCLUDED.items():
        assert any(fnmatch.fnmatchcase(n, pattern) for n in NAMES), f"{pattern!r} matches no case"
        assert ex.kind in ("skip", "kernel-bug", "by-design", "partial") and ex.reason
        assert (ex.kind == "kernel-bug") == ex.reason.startswith("KERNEL BUG:"), pattern
        assert (ex.kind == "partial") == bool(ex.unchecked), pattern


def test_the_cases_cover_the_brief():
    """Every mapped operator with ONNX node tests has cases, and the pytorch-converted families
    the conformance note names are there (Conv1d/Conv3d, 1-D and 3-D pools)."""
    by_source = {c.source for c in oc.cases().values()}
    assert by_source == {"node", "pytorch-converted", "onnx-reference"}
    for prefix in ("test_Conv1d", "test_Conv3d", "test_AvgPool1d", "test_MaxPool1d", "test_AvgPool3d",
                   "test_MaxPool3d"):
        assert any(n.startswith(prefix) for n in NAMES), prefix
    ops = {t for c in oc.cases().values() for t in c.op_types}
    for op_type in ("MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Transpose", "Reshape", "Concat", "Split",
                    "Clip", "Softmax", "LayerNormalization", "RMSNormalization", "RotaryEmbedding", "Attention",
                    "GroupNormalization", "InstanceNormalization", "BatchNormalization", "Conv",
                    "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize",
                    "DepthToSpace", "SpaceToDepth", "Gelu", "Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh",
                    "ArgMax", "QuantizeLinear", "DequantizeLinear", "Gather"):
        assert op_type in CONVERTERS and op_type in ops, op_type


def test_conformance_table_is_fresh():
    assert oc.table_in_docs() == oc.render_table(oc.outcomes()), (
        "docs/ops.md's ONNX conformance table is stale: run `python scripts/onnx_conformance_table.py`")


def test_no_case_fails_outside_the_test_run():
    failing = {n: o.reason for n, o in oc.outcomes().items() if o.status == "failed"}
    assert not failing, failing


# -- the converters' refusals ------------------------------------------------------------------
def _infos(**arrays) -> list[OnnxValue]:
    return [OnnxValue.of(name, a) for name, a in arrays.items()]


def test_asymmetric_conv_padding_is_refused_naming_the_op_and_the_reason():
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 0, 0, 0])
    x, w = np.zeros((1, 1, 5, 5), np.float32), np.zeros((1, 1, 3, 3), np.float32)
    with pytest.raises(UnsupportedOnnxError, match=r"ONNX Conv.*asymmetric padding") as info:
        convert_node(node, 22, _infos(x=x, w=w))
    assert isinstance(info.value, DistRuntimeError) and info.value.op_type == "Conv"


def test_same_padding_that_comes_out_symmetric_is_accepted():
    node = helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])
    x, w = np.zeros((1, 1, 5, 5), np.float32), np.zeros((1, 1, 3, 3), np.float32)
    (conv,) = convert_node(node, 22, _infos(x=x, w=w)).nodes
    assert (conv.op.padding_h, conv.op.padding_w) == (1, 1)


def test_an_unknown_attribute_is_refused():
    node = helper.make_node("Relu", ["x"], ["y"], future_attribute=3)
    with pytest.raises(UnsupportedOnnxError, match="future_attribute"):
        convert_node(node, 14, _infos(x=np.zeros(3, np.float32)))


def test_an_op_without_converter_is_refused():
    node = helper.make_node("Elu", ["x"], ["y"])
    with pytest.raises(UnsupportedOnnxError, match="no converter"):
        convert_node(node, 6, _infos(x=np.zeros(3, np.float32)))


def test_reshape_needs_its_shape_as_a_constant():
    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    infos = [OnnxValue.of("x", np.zeros((2, 3), np.float32)), OnnxValue.of("shape", np.array([3, 2]))]
    with pytest.raises(UnsupportedOnnxError, match="must be a constant"):
        convert_node(node, 14, infos)
    infos[1] = OnnxValue.of("shape", np.array([3, 2]), constant=True)
    (reshape,) = convert_node(node, 14, infos).nodes
    assert reshape.op.shape == (3, 2) and reshape.outputs == ["y"]


def test_space_to_depth_composes_pixel_unshuffle_with_a_channel_permutation():
    """ONNX SpaceToDepth orders channels (i*r + j)*C + c; PixelUnshuffle c*r*r + i*r + j."""
    node = helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2)
    x = np.arange(2 * 3 * 4 * 6, dtype=np.float32).reshape(2, 3, 4, 6)
    converted = convert_node(node, 13, _infos(x=x))
    assert type(converted.nodes[0].op).__name__ == "PixelUnshuffle"
    model = helper.make_model(helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, x.shape)],
                                                [helper.make_tensor_value_info("y", 1, None)]),
                              opset_imports=[helper.make_opsetid("", 13)])
    case = oc.Case("space_to_depth", "unit", model, {"x": x}, {}, 1e-6, 0)
    run = oc.run_case(case)
    n, c, h, w = x.shape
    expect = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 3, 5, 1, 2, 4).reshape(n, 4 * c, h // 2, w // 2)
    np.testing.assert_array_equal(run.values["y"], expect)


def test_gemm_composes_matmul_mul_and_add():
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], alpha=0.5, beta=2.0, transA=1)
    a, b, c = np.zeros((4, 3), np.float32), np.zeros((4, 5), np.float32), np.zeros((5,), np.float32)
    converted = convert_node(node, 13, _infos(a=a, b=b, c=c))
    assert [type(n.op).__name__ for n in converted.nodes] == ["Transpose", "Matmul", "Mul", "Mul", "Add"]
    assert converted.nodes[-1].outputs == ["y"] and len(converted.constants) == 2


def test_onnx_modelproto_is_not_needed_to_convert():
    """Converters take a bare NodeProto: the importer feeds them node by node."""
    node = onnx.NodeProto()
    node.op_type, node.input[:], node.output[:] = "Sigmoid", ["x"], ["y"]
    (sig,) = convert_node(node, 13, _infos(x=np.zeros(2, np.float32))).nodes
    assert sig.op_name == "Sigmoid"
