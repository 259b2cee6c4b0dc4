"""The ONNX importer (dist_runtime/importers/onnx/model.py): whole ONNX models to our graph, run
with the GraphExecutor.

* Conformance: every ONNX conformance case that passes node by node (tests/onnx_conformance.py's
  cases minus EXCLUDED) also passes as a whole model through the importer and the executor.
* Real models exported from PyTorch (tests/fixtures/make_onnx_fixtures.py): a small CNN and a
  two-layer transformer encoder whose graph computes its reshape targets from Shape; outputs
  match ONNX's reference implementation, onnxruntime and torch, through ``load`` and through
  ``dist-runtime convert``.
* Folding, dynamic dims, quantized storage, and the errors: unsupported operators (all listed at
  once), unreadable files, a missing external file, a missing initializer; nothing is written on
  failure.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_conformance as oc
from dist_runtime.cli import main
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers import convert
from dist_runtime.importers.onnx import UnsupportedOnnxError
from dist_runtime.importers.onnx.model import OnnxImportError, UnsupportedOperatorsError, convert_onnx, load
from dist_runtime.model import load_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "onnx"
MODELS = ("cnn", "encoder")
F = TensorProto.FLOAT


# -- conformance through the importer --------------------------------------------------------------
def _passing(name: str) -> bool:
    ex = oc.exclusion(name)
    return ex is None or ex.kind == "partial"


PASSING = sorted(n for n in oc.cases() if _passing(n))


@pytest.mark.parametrize("name", PASSING)
def test_conformance_case_as_a_whole_model(name):
    ex = oc.exclusion(name)
    oc.check_imported(oc.cases()[name], ex.unchecked if ex is not None else ())


def test_the_imported_conformance_runs_every_passing_case():
    assert len(PASSING) > 400
    assert {oc.cases()[n].source for n in PASSING} == {"node", "pytorch-converted", "onnx-reference"}


# -- real models -----------------------------------------------------------------------------------
def fixture(name: str) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """(inputs, {source: outputs}) of a fixture: source is reference, onnxruntime or torch."""
    feeds, refs = {}, {}
    with np.load(FIXTURES / f"{name}.npz") as z:
        for key in z.files:
            source, tensor = key.split(":", 1)
            if source == "input":
                feeds[tensor] = z[key]
            else:
                refs.setdefault(source, {})[tensor] = z[key]
    return feeds, refs


def assert_matches_references(name: str, outputs: dict[str, np.ndarray]) -> None:
    _, refs = fixture(name)
    assert {"reference", "torch"} <= set(refs)
    for source, expected in refs.items():
        assert set(outputs) == set(expected)
        for tensor, want in expected.items():
            np.testing.assert_allclose(outputs[tensor], want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} {tensor} vs {source}")


@pytest.mark.parametrize("name", MODELS)
def test_exported_model_matches_references(name):
    imported = load(FIXTURES / f"{name}.onnx")
    feeds, _ = fixture(name)
    assert imported.graph.input_names == list(feeds)
    assert [list(s.shape) for s in imported.graph.inputs] == [list(a.shape) for a in feeds.values()]
    assert_matches_references(name, GraphExecutor((imported.graph, imported.weights)).run(feeds))


def test_cnn_keeps_its_layers():
    imported = load(FIXTURES / "cnn.onnx")
    ops = [n.op_name for n in imported.graph.nodes]
    assert ops.count("Conv2d") == 2 and ops.count("BatchNorm") == 2 and "Pool" in ops and "Matmul" in ops
    assert sum(w.size for w in imported.weights.values()) < 5000


def test_encoder_shape_arithmetic_is_folded_away():
    """The exported encoder computes its attention reshapes from Shape at run time; after import
    no shape arithmetic is left and every Reshape has a static target."""
    raw = onnx.load(str(FIXTURES / "encoder.onnx"))
    raw_ops = {n.op_type for n in raw.graph.node}
    assert {"Shape", "Gather", "Concat", "Reshape"} <= raw_ops
    imported = load(FIXTURES / "encoder.onnx")
    ops = {n.op_name for n in imported.graph.nodes}
    assert {"LayerNorm", "Softmax", "Gelu", "Matmul"} <= ops
    assert imported.config.folded >= sum(n.op_type in ("Shape", "Constant") for n in raw.graph.node)
    assert imported.metadata["source"]["folded_nodes"] == imported.config.folded


@pytest.mark.parametrize("name", MODELS)
def test_cli_convert_writes_a_model_that_runs(name, tmp_path, capsys):
    out = tmp_path / f"{name}.model"
    assert main(["convert", str(FIXTURES / f"{name}.onnx"), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    imported = load(FIXTURES / f"{name}.onnx")
    assert report["format"] == "onnx" and report["architecture"] == "onnx"
    assert report["tensors"] == len(imported.weights)
    assert report["dtypes"] == dict(Counter(imported.stored.values())) and report["dtypes"]["f32"] > 10
    assert sum(report["ops"].values()) == len(imported.graph.nodes)
    model = load_model(out)
    assert model.metadata["source"]["format"] == "onnx"
    feeds, _ = fixture(name)
    assert_matches_references(name, GraphExecutor(model).run(feeds))


def test_cli_report_names_the_ops(tmp_path, capsys):
    assert main(["convert", str(FIXTURES / "cnn.onnx"), "-o", str(tmp_path / "cnn.model"), "-q"]) == 0
    text = capsys.readouterr().out
    assert "onnx onnx, 14 tensors" in text and "Conv2d 2" in text and "BatchNorm 2" in text


@pytest.mark.parametrize("dtype, tol", [("f16", 5e-3), ("q8_0", 5e-2)])
def test_dtype_stores_matmul_weights(dtype, tol):
    imported = load(FIXTURES / "encoder.onnx", dtype)
    stored = imported.stored
    matmul_b = {n.inputs[1] for n in imported.graph.nodes if n.op_name == "Matmul"} & set(stored)
    assert matmul_b and any(stored[n] == dtype for n in matmul_b)
    floats = {n for n, w in imported.weights.items() if not DType[stored[n].upper()].is_integer}
    assert all(stored[n] in (dtype, "f32") for n in floats)
    assert all(stored[n] == "f32" for n in floats - matmul_b)
    feeds, refs = fixture("encoder")
    out = GraphExecutor((imported.graph, imported.weights)).run(feeds)["hidden"]
    np.testing.assert_allclose(out, refs["reference"]["hidden"], atol=tol * np.abs(out).max())


# -- hand-made models ------------------------------------------------------------------------------
def make_model(nodes, inputs, outputs, initializers=(), opset=17, **kw) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kw)


def vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)


def test_symbolic_dims_become_minus_one_and_any_batch_runs():
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                       [vi("x", ["batch", 4])], [vi("y", ["batch", 3])], [numpy_helper.from_array(W, "w")])
    imported = load(model)
    assert imported.graph.input_names == ["x"] and imported.graph.inputs[0].shape == (-1, 4)
    assert imported.graph.outputs == ["y"] and list(imported.weights) == ["w"]
    ex = GraphExecutor((imported.graph, imported.weights))
    for batch in (1, 5):
        x = RNG.standard_normal((batch, 4)).astype(np.float32)
        np.testing.assert_allclose(ex.run({"x": x})["y"], np.maximum(x @ W, 0), rtol=1e-6)


def test_constants_and_shape_arithmetic_fold():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape and Constant + initializer arithmetic
    become constants: only the data path remains."""
    nodes = [
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.float32(2.0))),
        helper.make_node("Mul", ["w", "two"], ["w2"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w2"], ["y"]),
    ]
    inits = [numpy_helper.from_array(W, "w"), numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
             numpy_helper.from_array(np.ones(3, np.float32), "unused")]
    model = make_model(nodes, [vi("x", [3, 2, 2])], [vi("y", None)], inits)
    imported = load(model)
    assert [n.op_name for n in imported.graph.nodes] == ["Reshape", "Matmul"]
    assert imported.graph.nodes[0].op.shape == (3, -1)
    np.testing.assert_array_equal(imported.weights["w2"], 2 * W)
    assert imported.config.folded == 6 and imported.ignored == ["unused"]
    x = RNG.standard_normal((3, 2, 2)).astype(np.float32)
    y = GraphExecutor((imported.graph, imported.weights)).run({"x": x})["y"]
    np.testing.assert_allclose(y, x.reshape(3, 4) @ (2 * W), rtol=1e-6)


def test_an_output_that_is_a_constant_is_still_produced():
    model = make_model([helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(W)),
                        helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("c", [4, 3]), vi("y", [2])])
    imported = load(model)
    out = GraphExecutor((imported.graph, imported.weights)).run({"x": np.array([-1, 1], np.float32)})
    np.testing.assert_array_equal(out["c"], W)
    np.testing.assert_array_equal(out["y"], [0, 1])


def test_an_input_passed_through_to_an_output_is_refused():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2]), vi("x", [2])])
    with pytest.raises(OnnxImportError, match="graph output 'x' is a graph input"):
        load(model)


# -- errors ----------------------------------------------------------------------------------------
def unsupported_model() -> onnx.ModelProto:
    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"])], "body", [vi("c", [1])],
                             [vi("c_out", [1])])
    nodes = [
        helper.make_node("Elu", ["x"], ["a"], name="first_elu"),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Erf", ["b"], ["c"], name="erf"),
        helper.make_node("Elu", ["c"], ["d"]),  # unnamed: located by index
        helper.make_node("FusedMatMul", ["d", "d"], ["e"], domain="com.microsoft", name="fused"),
        helper.make_node("If", ["cond"], ["f"], then_branch=body, else_branch=body, name="branch"),
        helper.make_node("RandomNormal", [], ["g"], shape=[2], name="noise"),
        helper.make_node("Add", ["e", "g"], ["y"]),
    ]
    model = make_model(nodes, [vi("x", [2]), vi("cond", [], TensorProto.BOOL)], [vi("y", [2]), vi("f", [1])])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_every_unsupported_operator_is_listed_in_one_error():
    with pytest.raises(UnsupportedOperatorsError) as info:
        load(unsupported_model())
    err = info.value
    assert isinstance(err, UnsupportedOnnxError) and isinstance(err, DistRuntimeError)
    assert err.operators == {
        "Elu": ["node #0 'first_elu'", "node #3"],
        "Erf": ["node #2 'erf'"],
        "com.microsoft.FusedMatMul (domain com.microsoft)": ["node #4 'fused'"],
        "If (control flow with a subgraph)": ["node #5 'branch'"],
        "RandomNormal": ["node #6 'noise'"],
    }
    message = str(err)
    for part in ("5 operator(s)", "Elu at node #0 'first_elu', node #3", "Erf at node #2 'erf'",
                 "com.microsoft.FusedMatMul", "If (control flow", "RandomNormal"):
        assert part in message


def test_a_converter_refusal_names_the_node():
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 0, 0, 0], name="stem")
    model = make_model([node], [vi("x", [1, 1, 5, 5])], [vi("y", None)],
                       [numpy_helper.from_array(np.zeros((1, 1, 3, 3), np.float32), "w")])
    with pytest.raises(UnsupportedOnnxError, match=r"ONNX Conv \(node \"#0 'stem'\"\): .*asymmetric padding"):
        load(model)


def test_a_missing_initializer_is_named(tmp_path):
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], [vi("x", [2, 4])],
                       [vi("y", [2, 3])])
    with pytest.raises(OnnxImportError, match=r"node #0 'proj' \(MatMul\) reads 'w'.*missing initializer"):
        load(model)


@pytest.mark.parametrize("content", [b"", b"\x00garbage\xff" * 10, "truncated"])
def test_unreadable_files_are_refused_cleanly(tmp_path, content):
    path = tmp_path / "bad.onnx"
    if content == "truncated":
        data = (FIXTURES / "encoder.onnx").read_bytes()
        content = data[: len(data) // 2]
    path.write_bytes(content)
    with pytest.raises(OnnxImportError, match="bad.onnx"):
        load(path)


def test_a_file_over_the_size_cap_is_refused():
    with pytest.raises(OnnxImportError, match="over the importer's limit of 1,000"):
        load(FIXTURES / "cnn.onnx", max_bytes=1000)


def test_external_data_is_read(tmp_path):
    """More in tests/test_onnx_external.py."""
    model = onnx.load(str(FIXTURES / "cnn.onnx"))
    path = tmp_path / "external.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    feeds, _ = fixture("cnn")
    imported = load(path)
    assert_matches_references("cnn", GraphExecutor((imported.graph, imported.weights)).run(feeds))


def test_a_tensor_named_pos_is_refused():
    model = make_model([helper.make_node("Relu", ["pos"], ["y"])], [vi("pos", [2])], [vi("y", [2])])
    with pytest.raises(OnnxImportError, match="'pos'"):
        load(model)


@pytest.mark.parametrize("case", ["unsupported", "garbage", "external"])
def test_failed_conversion_leaves_nothing_behind(tmp_path, case, capsys):
    path = tmp_path / "in.onnx"
    if case == "unsupported":
        onnx.save_model(unsupported_model(), str(path))
    elif case == "garbage":
        path.write_bytes(b"not a protobuf" * 7)
    else:
        onnx.save_model(onnx.load(str(FIXTURES / "cnn.onnx")), str(path), save_as_external_data=True,
                        location="w.bin", size_threshold=0)
        (tmp_path / "w.bin").unlink()  # a missing external file
    before = set(tmp_path.iterdir())
    out = tmp_path / "out" / "m.model"
    with pytest.raises(OnnxImportError):
        convert_onnx(path, out)
    assert main(["convert", str(path), "-o", str(out)]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    assert set(tmp_path.iterdir()) == before  # no .model, no temporary file, no output directory


def test_convert_dispatches_onnx_files(tmp_path):
    report = convert(FIXTURES / "cnn.onnx", tmp_path / "cnn.model")
    assert report.format == "onnx" and report.ops["Conv2d"] == 2
    assert report.dtypes == {"f32": 14} and report.tensors == 14
