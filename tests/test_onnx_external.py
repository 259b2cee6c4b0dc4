"""ONNX models stored with external data (dist_runtime/importers/onnx/external.py), converted
through ``dist-runtime convert``'s entry point (``dist_runtime.importers.convert``).

* A 2-layer MLP, and a model whose weights go through folded Transpose, Reshape, Cast and Split,
  saved in one external file and in one file per tensor, convert to models whose outputs are
  bitwise those of the model saved inline, and close to ``onnx.reference``.
* Large external tensors stay on disk until written: the loaded weights are ``Deferred``, and at
  most one large tensor read from the external files is alive at a time during the write.
* ``--dtype`` quantizes a band of rows at a time, storing what quantizing the whole matrix does.
* Hostile external data (a location out of the model's directory by ``..``, an absolute path or
  a symlink; a missing file; offset or length beyond the file; a length that is not the shape's;
  unknown keys, negative numbers) is refused with an ``OnnxImportError`` naming the tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, external_data_helper, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from dist_runtime.cli import main
from dist_runtime.dtypes import DType
from dist_runtime.executor import GraphExecutor
from dist_runtime.importers import convert
from dist_runtime.importers.common import write_imported
from dist_runtime.importers.onnx import external
from dist_runtime.importers.onnx.model import OnnxImportError, load
from dist_runtime.kernels.quant import dequantize, quantize
from dist_runtime.model import load_model
from dist_runtime.tensor import Deferred

F = TensorProto.FLOAT
LAYOUTS = ("inline", "one-file", "per-tensor")


def vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mlp(seed: int = 0) -> onnx.ModelProto:
    """x[2,128] -> MatMul W1[128,512] + b1 -> Relu -> MatMul W2[512,64] + b2 -> y."""
    rng = np.random.default_rng(seed)
    inits = {"W1": rng.standard_normal((128, 512)), "b1": rng.standard_normal(512),
             "W2": rng.standard_normal((512, 64)) / 16, "b2": rng.standard_normal(64)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]), helper.make_node("MatMul", ["h2", "W2"], ["h3"]),
             helper.make_node("Add", ["h3", "b2"], ["y"])]
    return make_model(nodes, [vi("x", [2, 128])], [vi("y", [2, 64])],
                      [numpy_helper.from_array(v.astype(np.float32), n) for n, v in inits.items()])


def folded(seed: int = 1) -> onnx.ModelProto:
    """Weights stored other than as the MatMuls read them, all folded at import: ``Wt`` [256, 128]
    transposed, ``Wflat`` [32768] reshaped to [256, 128], ``W16`` f16 cast to f32, and a fused
    ``Wqkv`` [1024, 96] split in three."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((256, 128)).astype(np.float32), "Wt"),
             numpy_helper.from_array(rng.standard_normal(256 * 128).astype(np.float32) / 16, "Wflat"),
             numpy_helper.from_array(np.array([256, 128], np.int64), "flat_shape"),
             numpy_helper.from_array((rng.standard_normal((128, 1024)) / 8).astype(np.float16), "W16"),
             numpy_helper.from_array(rng.standard_normal((1024, 96)).astype(np.float32) / 32, "Wqkv")]
    nodes = [helper.make_node("Transpose", ["Wt"], ["W1"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "W1"], ["h1"]),
             helper.make_node("Reshape", ["Wflat", "flat_shape"], ["W2"]),
             helper.make_node("MatMul", ["h1", "W2"], ["h2"]),
             helper.make_node("Cast", ["W16"], ["W3"], to=F),
             helper.make_node("MatMul", ["h2", "W3"], ["h3"]),
             helper.make_node("Split", ["Wqkv"], ["Wq", "Wk", "Wv"], axis=1, num_outputs=3),
             helper.make_node("MatMul", ["h3", "Wq"], ["q"]), helper.make_node("MatMul", ["h3", "Wk"], ["k"]),
             helper.make_node("MatMul", ["h3", "Wv"], ["v"]), helper.make_node("Mul", ["q", "k"], ["qk"]),
             helper.make_node("Add", ["qk", "v"], ["y"])]
    model = make_model(nodes, [vi("x", [3, 128])], [vi("y", [3, 32])], inits)
    model.opset_import[0].version = 18  # Split's num_outputs
    return model


MODELS = {"mlp": mlp, "folded": folded}


def save(model: onnx.ModelProto, folder: Path, layout: str) -> Path:
    """``model`` saved as ``folder/model.onnx``: inline, or every tensor of over 1 KiB in external
    data, in one file (``model.onnx.data``) or in one file per tensor."""
    folder.mkdir(parents=True, exist_ok=True)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if layout != "inline":
        external_data_helper.convert_model_to_external_data(
            model, all_tensors_to_one_file=layout == "one-file", location="model.onnx.data", size_threshold=1024)
    onnx.save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def feeds_of(model: onnx.ModelProto, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
            for v in model.graph.input}


def run(path: Path, feeds) -> dict[str, np.ndarray]:
    return GraphExecutor(load_model(path)).run(feeds)


# -- conversion --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["one-file", "per-tensor"])
@pytest.mark.parametrize("name", MODELS)
def test_external_data_converts_like_inline(name, layout, tmp_path):
    model = MODELS[name]()
    src = save(model, tmp_path / layout, layout)
    assert any(external_data_helper.uses_external_data(t) for t in onnx.load(str(src), load_external_data=False)
               .graph.initializer)
    inline = save(model, tmp_path / "inline", "inline")
    convert(src, tmp_path / "external.model")
    convert(inline, tmp_path / "inline.model")
    feeds = feeds_of(model)
    got, want = run(tmp_path / "external.model", feeds), run(tmp_path / "inline.model", feeds)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    reference = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_allclose(got["y"], reference[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_dtype_with_external_data_stores_the_same_bytes(dtype, tmp_path):
    model = mlp()
    convert(save(model, tmp_path / "ext", "one-file"), tmp_path / "external.model", dtype)
    convert(save(model, tmp_path / "inline", "inline"), tmp_path / "inline.model", dtype)
    a, b = load_model(tmp_path / "external.model"), load_model(tmp_path / "inline.model")
    assert a.index == b.index and a.index["W1"].dtype.name.lower() == dtype
    feeds = feeds_of(model)
    np.testing.assert_array_equal(GraphExecutor(a).run(feeds)["y"], GraphExecutor(b).run(feeds)["y"])


def test_cli_converts_external_data(tmp_path, capsys):
    src = save(mlp(), tmp_path / "m", "per-tensor")
    assert main(["convert", str(src), "-o", str(tmp_path / "out.model"), "-q"]) == 0
    assert "4 tensors" in capsys.readouterr().out
    assert run(tmp_path / "out.model", feeds_of(mlp()))["y"].shape == (2, 64)


def test_two_large_external_inputs_are_left_to_a_run_time_node(tmp_path):
    """Folding ``A + B`` of two large external tensors would hold both: the Add runs instead."""
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((128, 256)).astype(np.float32) for _ in range(2))
    model = make_model([helper.make_node("Add", ["A", "B"], ["W"]), helper.make_node("MatMul", ["x", "W"], ["y"])],
                       [vi("x", [2, 128])], [vi("y", [2, 256])],
                       [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B")])
    imported = load(save(model, tmp_path / "ext", "one-file"))
    assert [n.op_name for n in imported.graph.nodes] == ["Add", "Matmul"]
    assert all(isinstance(w, Deferred) for w in imported.weights.values())
    convert(save(model, tmp_path / "ext", "one-file"), tmp_path / "ext.model")
    x = feeds_of(model)["x"]
    np.testing.assert_allclose(run(tmp_path / "ext.model", {"x": x})["y"], x @ (a + b), rtol=1e-5, atol=1e-4)


# -- streaming ---------------------------------------------------------------------------------------
def test_large_external_tensors_are_deferred_and_small_ones_read(tmp_path):
    imported = load(save(folded(), tmp_path, "one-file"))
    weights = imported.weights
    assert {n for n, w in weights.items() if isinstance(w, Deferred)} == {"W1", "W2", "W3", "Wq", "Wk", "Wv"}
    assert weights["W1"].shape == (128, 256) and weights["W3"].dtype.name == "F32"
    small = load(save(mlp(), tmp_path / "mlp", "one-file")).weights
    assert isinstance(small["b1"], np.ndarray) and isinstance(small["W1"], Deferred)


@pytest.mark.parametrize("name", MODELS)
def test_at_most_one_large_tensor_is_held_at_a_time(name, tmp_path, monkeypatch):
    """When a large external tensor is read, everything made for the tensors written before it
    (their reads, the folds made from them) has been given back."""
    held, reads = set(), []
    empty, release, read = external.Pages.empty, external.Pages.release, external.ExternalTensor.read

    def tracked_empty(self, shape, dtype):
        held.add(id(self))
        return empty(self, shape, dtype)

    def tracked_release(self):
        held.discard(id(self))
        release(self)

    def tracked_read(self, into=np.empty):
        if self.length > external.EAGER_BYTES:
            assert not held, f"{self.name} read while {len(held)} tensor(s) are still held"
            reads.append(self.name)
        return read(self, into)

    monkeypatch.setattr(external.Pages, "empty", tracked_empty)
    monkeypatch.setattr(external.Pages, "release", tracked_release)
    monkeypatch.setattr(external.ExternalTensor, "read", tracked_read)
    convert(save(MODELS[name](), tmp_path, "per-tensor"), tmp_path / "out.model")
    assert not held
    # each large tensor is read once, but folded's fused Wqkv once per output of its Split
    assert sorted(reads) == {"mlp": ["W1", "W2"], "folded": ["W16", "Wflat", "Wqkv", "Wqkv", "Wqkv", "Wt"]}[name]


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_released_pages_leave_resident_memory_even_while_a_view_is_held():
    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    pages = external.Pages()
    array = pages.empty((64, 2**18), np.dtype(np.float32))  # 64 MiB
    array.fill(1.0)
    view = array[-1]
    before = resident()
    pages.release()
    assert before - resident() > 60 * 2**20
    assert view.shape == (2**18,)


def test_a_file_changed_after_the_check_fails_cleanly(tmp_path):
    src = save(mlp(), tmp_path / "m", "one-file")
    imported = load(src)
    data = tmp_path / "m" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(OnnxImportError, match="initializer 'W1'.*model.onnx.data.*shorter"):
        write_imported(imported, tmp_path / "out" / "m.model", "onnx")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# -- hostile external data -----------------------------------------------------------------------------
def tamper(path: Path, tensor: str, **entries) -> None:
    """Rewrite ``tensor``'s external data entries (None removes one) in the model at ``path``."""
    model = onnx.load(str(path), load_external_data=False)
    (t,) = [t for t in model.graph.initializer if t.name == tensor]
    current = {e.key: e.value for e in t.external_data} | entries
    del t.external_data[:]
    for key, value in current.items():
        if value is not None:
            t.external_data.add(key=key, value=str(value))
    path.write_bytes(model.SerializeToString())


def _outside(src: Path) -> None:
    (src.parent.parent / "x").write_bytes(bytes(128 * 512 * 4))
    tamper(src, "W1", location="../x", offset=0)


def _absolute(src: Path) -> None:
    tamper(src, "W1", location=str(src.parent / "model.onnx.data"))


def _symlink(src: Path) -> None:
    outside = src.parent.parent / "outside.data"
    outside.write_bytes((src.parent / "model.onnx.data").read_bytes())
    (src.parent / "link.data").symlink_to(outside)
    tamper(src, "W1", location="link.data")


def _dims(src: Path) -> None:
    model = onnx.load(str(src), load_external_data=False)
    model.graph.initializer[0].dims[1] = 511
    src.write_bytes(model.SerializeToString())


BAD = {
    "dotdot": (_outside, r"location '\.\./x' resolves to .*outside the model's directory"),
    "absolute": (_absolute, "is an absolute path"),
    "symlink": (_symlink, "location 'link.data' resolves to .*outside.data.*outside the model's directory"),
    "missing": (lambda s: tamper(s, "W1", location="gone.data"), "gone.data' does not exist"),
    "offset": (lambda s: tamper(s, "W1", offset=10**9), "offset 1000000000 is past the end of .*model.onnx.data"),
    "length": (lambda s: tamper(s, "W1", offset=4096, length=10**9),
               "offset 4096 \\+ length 1000000000 is past the end of .*model.onnx.data"),
    "short length": (lambda s: tamper(s, "W1", length=128 * 512 * 4 - 4),
                     "length 262140 in .*model.onnx.data.* is not the 262144 bytes of float32\\[128, 512\\]"),
    "shape": (_dims, "length 262144 .* is not the 261632 bytes of float32\\[128, 511\\]"),
    "no length, wrong size": (lambda s: tamper(s, "W1", length=None), "length .* is not the 262144 bytes"),
    "unknown key": (lambda s: tamper(s, "W1", basepath="/etc"), "unknown key 'basepath'"),
    "negative": (lambda s: tamper(s, "W1", offset=-4), "offset '-4' is not a non-negative decimal integer"),
    "no location": (lambda s: tamper(s, "W1", location=None), "no usable location"),
}


@pytest.mark.parametrize("case", BAD)
def test_hostile_external_data_is_refused_naming_the_tensor(case, tmp_path, capsys):
    src = save(mlp(), tmp_path / "m", "one-file")
    edit, message = BAD[case]
    edit(src)
    with pytest.raises(OnnxImportError, match=f"model.onnx: initializer 'W1': external data .*{message}"):
        load(src)
    out = tmp_path / "out" / "m.model"
    assert main(["convert", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'W1'" in err and "Traceback" not in err
    assert not out.exists()


def test_external_data_needs_the_model_file(tmp_path):
    model = onnx.load(str(save(mlp(), tmp_path, "one-file")), load_external_data=False)
    with pytest.raises(OnnxImportError, match="W1, b1, W2 are stored as external data: load the model from its file"):
        load(model)


def test_external_attribute_tensors_are_refused(tmp_path):
    value = numpy_helper.from_array(np.ones((64, 64), np.float32), "c")
    model = make_model([helper.make_node("Constant", [], ["w"], value=value),
                        helper.make_node("MatMul", ["x", "w"], ["y"])], [vi("x", [1, 64])], [vi("y", [1, 64])], [])
    external_data_helper.convert_model_to_external_data(model, location="d.bin", convert_attribute=True)
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    with pytest.raises(OnnxImportError, match="node attribute tensor.*c.*convert_attribute=False"):
        load(tmp_path / "model.onnx")


@pytest.mark.parametrize("target", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_quantizing_by_bands_stores_what_quantizing_at_once_does(target, monkeypatch):
    """Every importer re-encodes through ``quantize_rows``: from f32 rows, and from a block type
    decoded band by band (a GGUF's Q4_0 re-stored as ``--dtype``)."""
    from dist_runtime.importers import common

    monkeypatch.setattr(common, "QUANTIZE_BAND", 3 * 64 * 4)  # 3 rows of 64 at a time
    w = np.random.default_rng(4).standard_normal((10, 64)).astype(np.float32)
    for source in (w, quantize(w, DType.Q4_0)):
        banded = common.quantize_rows(source, DType[target])
        whole = quantize(dequantize(source) if source is not w else w, DType[target])
        assert type(banded) is type(whole)
        if isinstance(whole, np.ndarray):
            assert banded.dtype == whole.dtype and banded.tobytes() == whole.tobytes()
        else:
            assert banded.shape == whole.shape and np.array_equal(banded.data, whole.data)
