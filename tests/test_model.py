"""The .model container: save/load round trips, alignment, zero-copy views, subset loading."""

from __future__ import annotations

import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from conftest import mini_graph, q8_0_blocks
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError, GraphValidationError, ModelFormatError
from dist_runtime.ir.codec import encode_graph
from dist_runtime.ir.graph import Graph, Node, TensorSpec
from dist_runtime.ir.ops import Add
from dist_runtime.model import (
    ALIGN,
    MAGIC,
    Model,
    UnknownTensorError,
    encode_container,
    encode_index,
    load_model,
    read_sections,
    save_model,
)
from dist_runtime.tensor import QuantizedArray, dtype_of

PLAIN = [d for d in DType if not d.is_quantized]
BLOCK = [d for d in DType if d.is_quantized]


def _random_plain(dtype: DType, shape, rng) -> np.ndarray:
    if dtype is DType.BOOL:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.is_integer:
        info = np.iinfo(dtype.numpy)
        return rng.integers(info.min, info.max, shape, dtype=dtype.numpy, endpoint=True)
    return rng.standard_normal(shape).astype(dtype.numpy)


def _mm_base(model: Model) -> np.ndarray:
    return np.frombuffer(model._mm, np.uint8)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", PLAIN, ids=lambda d: d.name)
def test_plain_dtypes_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(int(dtype))
    weights = {
        "a": _random_plain(dtype, (3, 5), rng),
        "scalar": _random_plain(dtype, (), rng),
        "empty": _random_plain(dtype, (0, 4), rng),
        "vec": _random_plain(dtype, (7,), rng),
    }
    save_model(tmp_path / "m.model", None, weights).close()
    with load_model(tmp_path / "m.model") as m:
        assert m.graph is None and list(m.index) == list(weights)
        for name, want in weights.items():
            got = m.weights[name]
            assert isinstance(got, np.ndarray)
            assert got.dtype == dtype.numpy and got.shape == want.shape
            assert got.tobytes() == np.ascontiguousarray(want, dtype.numpy).tobytes()
            assert m.index[name] == TensorSpec(want.shape, dtype, m.index[name].offset, want.nbytes)
    if dtype is DType.BF16:
        assert weights["a"].dtype == ml_dtypes.bfloat16


def test_non_native_arrays_are_written_little_endian_c_order(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    weights = {"be": x.astype(">f4"), "fortran": np.asfortranarray(x), "strided": x[:, ::2],
               "list": [[1, 2], [3, 4]]}
    save_model(tmp_path / "m.model", None, weights).close()
    with load_model(tmp_path / "m.model") as m:
        np.testing.assert_array_equal(m.weights["be"], x)
        assert m.weights["be"].dtype == np.dtype("<f4")
        np.testing.assert_array_equal(m.weights["fortran"], x)
        np.testing.assert_array_equal(m.weights["strided"], x[:, ::2])
        assert m.weights["list"].dtype == np.int64
        raw = Path(tmp_path / "m.model").read_bytes()
        off, size = m.byte_range("be")
        assert raw[off : off + size] == x.astype("<f4").tobytes()


@pytest.mark.parametrize("dtype", [DType.Q8_0, DType.Q4_0], ids=lambda d: d.name)
def test_gguf_quantized_blocks_round_trip(tmp_path, dtype):
    import gguf.quants
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[dtype.name]
    blocks = gguf.quants.quantize(x, qtype)
    assert blocks.shape == (4, 96 // 32 * dtype.block_bytes)
    q = QuantizedArray(blocks, dtype, (4, 96))
    save_model(tmp_path / "q.model", None, {"w": q, "bias": x[0]}).close()
    with load_model(tmp_path / "q.model") as m:
        got = m.weights["w"]
        assert isinstance(got, QuantizedArray)
        assert got.dtype is dtype and got.shape == (4, 96) and got.data.shape == blocks.shape
        assert got.data.tobytes() == blocks.tobytes()
        np.testing.assert_array_equal(gguf.quants.dequantize(got.data, qtype),
                                      gguf.quants.dequantize(blocks, qtype))
        assert m.index["w"].size == dtype.nbytes((4, 96))
        assert np.shares_memory(got.data, _mm_base(m))


@pytest.mark.parametrize("dtype", BLOCK, ids=lambda d: d.name)
def test_every_block_type_keeps_its_raw_bytes(tmp_path, dtype):
    rng = np.random.default_rng(int(dtype))
    shape = (3, 2, 2 * dtype.block_size)
    raw = rng.integers(0, 256, (3, 2, 2 * dtype.block_bytes), dtype=np.uint8)
    save_model(tmp_path / "q.model", None, {"t": QuantizedArray(raw, dtype, shape)}).close()
    with load_model(tmp_path / "q.model") as m:
        got = m.weights["t"]
        assert got.dtype is dtype and got.shape == shape
        np.testing.assert_array_equal(got.data, raw)


def test_graph_round_trip_binary(tmp_path, decoder):
    graph, weights, metadata = decoder
    saved = save_model(tmp_path / "d.model", graph, weights, metadata)
    assert graph.weights == {}, "save_model must not mutate the caller's graph"
    with load_model(tmp_path / "d.model") as m:
        assert m.graph_format == "binary"
        assert m.graph == Graph(graph.nodes, graph.inputs, graph.outputs, m.index)
        assert m.graph == saved.graph
        assert m.graph.weights == m.index and set(m.index) == set(weights)
        assert m.graph.input_names == ["tokens"]
        assert m.warnings == []
        assert m.metadata == metadata
    saved.close()


def test_graph_round_trip_toml_keeps_attrs(tmp_path, decoder):
    graph, weights, metadata = decoder
    graph.nodes[3].attrs = {"fuse": True, "note": "q projection", "tile": (4, 8)}
    save_model(tmp_path / "t.model", graph, weights, metadata, graph_format="toml").close()
    save_model(tmp_path / "b.model", graph, weights, metadata).close()
    with load_model(tmp_path / "t.model") as t, load_model(tmp_path / "b.model") as b:
        assert t.graph_format == "toml" and b.graph_format == "binary"
        assert t.graph == Graph(graph.nodes, graph.inputs, graph.outputs, t.index)
        assert t.graph.nodes[3].attrs == graph.nodes[3].attrs
        assert b.graph.nodes[3].attrs == {}  # the binary form does not carry attrs
        assert encode_graph(t.graph) == encode_graph(b.graph)
        assert [s.name for s in t.sections] == ["metadata.toml", "tensors.toml", "graph.toml", "weights", "end"]


def test_metadata_round_trip(tmp_path):
    import datetime

    metadata = {
        "name": "модель ✓",
        "architecture": "llama",
        "max_memory": 2**40,
        "created_by": "test",
        "config": {"hidden": 16, "eps": 1e-5, "tied": False, "layers": [1, 2, 3]},
        "tokenizer": {"chat_template": "{% for m in messages %}\n\"{{ m }}\"{% endfor %}"},
        "when": datetime.datetime(2024, 1, 2, 3, 4, 5),
        "nested": {"a": {"b": {"c": [1.5, -0.0, float("inf")]}}},
    }
    save_model(tmp_path / "m.model", None, {}, metadata).close()
    with load_model(tmp_path / "m.model") as m:
        assert m.metadata == metadata
        assert m.index == {} and m.weights == {} and m.graph is None
        assert [s.name for s in m.sections] == ["metadata.toml", "end"]


@pytest.mark.parametrize("bad", [{"max_memory": True}, {"max_memory": -1}, {"name": 3},
                                 {"architecture": ["x"]}, {"created_by": None}])
def test_reserved_metadata_types_are_checked(tmp_path, bad):
    with pytest.raises((ValueError, TypeError)):
        save_model(tmp_path / "m.model", None, {}, bad)
    assert not (tmp_path / "m.model").exists()
    if None in bad.values():
        return  # TOML cannot express it
    import tomli_w

    raw = encode_container([("metadata.toml", tomli_w.dumps(bad).encode())])
    (tmp_path / "m.model").write_bytes(raw)
    with pytest.raises(ModelFormatError, match="metadata"):
        load_model(tmp_path / "m.model")


def test_section_kinds(tmp_path, decoder):
    graph, weights, metadata = decoder
    with save_model(tmp_path / "g.model", graph, {}, {}) as m:  # graph only
        assert [s.name for s in m.sections] == ["metadata.toml", "graph", "end"]
        assert m.graph.input_names[0] == "tokens" and m.index == {}
    with save_model(tmp_path / "w.model", None, weights) as m:  # weights only
        assert [s.name for s in m.sections] == ["metadata.toml", "tensors.toml", "weights", "end"]
        assert m.graph is None and len(m.weights) == len(weights)


# -- layout ------------------------------------------------------------------------------------
def test_every_tensor_and_section_is_64_byte_aligned(tmp_path, decoder):
    graph, weights, metadata = decoder
    rng = np.random.default_rng(0)
    weights = dict(weights) | {f"odd{i}": rng.standard_normal(i).astype(np.float32) for i in range(1, 9)}
    weights["q"] = q8_0_blocks(rng.standard_normal((3, 32)).astype(np.float32))
    save_model(tmp_path / "a.model", None, weights, metadata).close()
    raw = (tmp_path / "a.model").read_bytes()
    with load_model(tmp_path / "a.model") as m:
        for s in m.sections:
            assert s.offset % ALIGN == 0
        assert m.sections[-1].end == len(raw)
        base = _address(_mm_base(m))
        for name in weights:
            off, size = m.byte_range(name)
            assert off % ALIGN == 0 and m.index[name].offset % ALIGN == 0
            arr = m.weights[name]
            arr = arr.data if isinstance(arr, QuantizedArray) else arr
            assert _address(arr) - base == off and arr.nbytes == size
            assert _address(arr) % ALIGN == 0
        # insertion order, each tensor at the next multiple of 64 after the previous one's end
        end = 0
        for name in weights:
            spec = m.index[name]
            assert spec.offset == -(-end // ALIGN) * ALIGN
            end = spec.offset + spec.size


def test_file_layout_is_exactly_as_documented(tmp_path):
    x = np.arange(3, dtype=np.float32)
    save_model(tmp_path / "m.model", None, {"x": x, "y": x}, {"name": "n"}).close()
    raw = (tmp_path / "m.model").read_bytes()
    meta = b'name = "n"\n'
    index = encode_index({"x": TensorSpec((3,), DType.F32, 0, 12),
                          "y": TensorSpec((3,), DType.F32, 64, 12)}).encode()
    expect = bytearray(MAGIC)
    for name, data in [("metadata.toml", meta), ("tensors.toml", index),
                       ("weights", x.tobytes() + bytes(52) + x.tobytes()), ("end", b"")]:
        expect += f"~~~{name} {len(data)}\n".encode()
        expect += bytes(-len(expect) % 64)
        expect += data
    assert raw == bytes(expect)
    assert raw.startswith(b"~~~model 1\n~~~metadata.toml 11\n" + bytes(33) + b'name = "n"\n')
    assert raw == encode_container([("metadata.toml", meta), ("tensors.toml", index),
                                    ("weights", x.tobytes() + bytes(52) + x.tobytes())])


def test_extension_sections_are_skipped(tmp_path):
    import tomli_w

    x = np.arange(4, dtype=np.float32)
    index = encode_index({"x": TensorSpec((4,), DType.F32, 0, 16)}).encode()
    raw = encode_container([("x-before", b"\xff" * 5), ("metadata.toml", tomli_w.dumps({}).encode()),
                            ("x-vendor.blob", b"anything"), ("tensors.toml", index),
                            ("weights", x.tobytes()), ("x-after", b"")])
    (tmp_path / "x.model").write_bytes(raw)
    with load_model(tmp_path / "x.model") as m:
        np.testing.assert_array_equal(m.weights["x"], x)
        assert [s.name for s in m.sections][0] == "x-before"


# -- zero copy and subsets ---------------------------------------------------------------------
def test_weights_are_read_only_zero_copy_views(decoder_path):
    with load_model(decoder_path) as m:
        base = _mm_base(m)
        for name, arr in m.weights.items():
            assert not arr.flags.owndata and not arr.flags.writeable
            assert np.shares_memory(arr, base), name
            with pytest.raises(ValueError):
                arr[...] = 0


def test_subset_loading_maps_only_the_requested_tensors(decoder_path):
    wanted = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    with load_model(decoder_path) as full:
        ref = {k: np.array(v) for k, v in full.weights.items()}
        all_names = list(full.index)
    with load_model(decoder_path, tensors=wanted) as m:
        assert list(m.weights) == wanted
        assert list(m.index) == all_names  # the whole index is still there
        base = _address(_mm_base(m))
        weights = next(s for s in m.sections if s.name == "weights")
        for name in wanted:
            off, size = m.byte_range(name)
            assert weights.offset <= off and off + size <= weights.end
            assert _address(m.weights[name]) - base == off and m.weights[name].nbytes == size
            np.testing.assert_array_equal(m.weights[name], ref[name])
        # another tensor is mapped on demand, and then cached
        t = m.tensor("lm_head.weight")
        assert m.tensor("lm_head.weight") is t and "lm_head.weight" in m.weights
        np.testing.assert_array_equal(t, ref["lm_head.weight"])
    with load_model(decoder_path, tensors=[]) as m:
        assert m.weights == {} and len(m.index) == len(all_names)


def test_subset_loading_does_not_read_other_tensors(decoder_path, tmp_path):
    """Scribbling over every byte of the weights section outside the requested tensors changes
    nothing: the loader neither reads nor checks them."""
    wanted = ["model.norm.weight"]
    raw = bytearray(decoder_path.read_bytes())
    with load_model(decoder_path, tensors=wanted) as m:
        keep = {m.byte_range(n) for n in wanted}
        w = next(s for s in m.sections if s.name == "weights")
        ref = np.array(m.weights["model.norm.weight"])
    for i in range(w.offset, w.end):
        if not any(o <= i < o + s for o, s in keep):
            raw[i] = 0xA5
    (tmp_path / "s.model").write_bytes(raw)
    with load_model(tmp_path / "s.model", tensors=wanted) as m:
        np.testing.assert_array_equal(m.weights["model.norm.weight"], ref)


def test_unknown_tensor_names_are_clear_errors(decoder_path):
    with pytest.raises(UnknownTensorError, match=r"'model\.norm\.weight'") as e:
        load_model(decoder_path, tensors=["model.norm.weigth"])
    assert isinstance(e.value, KeyError) and isinstance(e.value, DistRuntimeError)
    assert "model.norm.weigth" in str(e.value)
    with load_model(decoder_path, tensors=[]) as m:
        with pytest.raises(UnknownTensorError, match="nearby names"):
            m.tensor("model.layers.0.mlp.up_proj")
        with pytest.raises(UnknownTensorError, match="holds 12 tensors"):
            m.byte_range("zzz")


def test_close_and_views_outliving_the_model(decoder_path):
    m = load_model(decoder_path)
    w = m.weights["model.norm.weight"]
    ref = np.array(w)
    m.close()
    m.close()  # idempotent
    np.testing.assert_array_equal(w, ref)  # the mapping lives while a view does
    assert m.weights == {} and "closed" in repr(m)
    with pytest.raises(DistRuntimeError, match="closed"):
        m.tensor("model.norm.weight")


# -- saving ------------------------------------------------------------------------------------
def test_save_is_atomic_and_leaves_no_temp_files(tmp_path, decoder):
    graph, weights, metadata = decoder
    path = tmp_path / "d.model"
    old = save_model(path, graph, weights, metadata)
    old_w = old.weights["lm_head.weight"]
    ref = np.array(old_w)
    # overwrite while the old file is mapped: the old views stay valid (a new inode replaces it)
    weights2 = {k: v + 1 for k, v in weights.items()}
    with save_model(path, graph, weights2, metadata) as new:
        np.testing.assert_array_equal(new.weights["lm_head.weight"], ref + 1)
    np.testing.assert_array_equal(old_w, ref)
    old.close()
    # a failing save leaves the previous file untouched and no temporary behind
    before = path.read_bytes()
    with pytest.raises(TypeError, match="complex"):
        save_model(path, graph, {**weights2, "bad": np.zeros(2, np.complex64)}, metadata)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.model"]
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_save_checks_graph_weights_against_the_weights(tmp_path, decoder):
    graph, weights, metadata = decoder
    g = Graph(graph.nodes, graph.inputs, graph.outputs,
              {n: TensorSpec(v.shape, DType.F32) for n, v in weights.items()})
    with save_model(tmp_path / "ok.model", g, weights, metadata) as m:
        assert m.graph.weights == m.index
    g.weights["model.norm.weight"] = TensorSpec((3,), DType.F32)
    with pytest.raises(GraphValidationError, match="model.norm.weight"):
        save_model(tmp_path / "bad.model", g, weights, metadata)
    del g.weights["model.norm.weight"]
    with pytest.raises(GraphValidationError, match=r"not in the graph \[.model.norm.weight.\]"):
        save_model(tmp_path / "bad.model", g, weights, metadata)


@pytest.mark.parametrize("name", ["", 3, "bad\udc80"])
def test_save_rejects_bad_weight_names(tmp_path, name):
    with pytest.raises(ValueError):
        save_model(tmp_path / "m.model", None, {name: np.zeros(2, np.float32)})


def test_tensor_names_with_quotes_and_unicode(tmp_path):
    names = ['a"b', "back\\slash", "tab\tnew\nline", "ünïcødé ✓", "x" * 300, "a.b.c.d.e.f.g.h.i.j"]
    weights = {n: np.full(2, i, np.float32) for i, n in enumerate(names)}
    save_model(tmp_path / "m.model", None, weights).close()
    with load_model(tmp_path / "m.model") as m:
        assert list(m.weights) == names
        for i, n in enumerate(names):
            assert m.weights[n][0] == i


# -- validation --------------------------------------------------------------------------------
def test_load_validates_the_graph_against_max_memory(tmp_path, decoder):
    graph, weights, metadata = decoder
    save_model(tmp_path / "small.model", graph, weights, metadata | {"max_memory": 1000}).close()
    with pytest.raises(GraphValidationError, match="memory"):
        load_model(tmp_path / "small.model")
    with load_model(tmp_path / "small.model", validate=False) as m:
        assert m.graph is not None and m.warnings == []


def test_load_reports_validation_warnings(tmp_path, decoder):
    graph, weights, metadata = decoder
    weights = dict(weights) | {"model.unused.weight": np.zeros(4, np.float32)}
    save_model(tmp_path / "w.model", graph, weights, metadata).close()
    with load_model(tmp_path / "w.model") as m:
        assert any("model.unused.weight" in w for w in m.warnings)


def test_load_rejects_an_invalid_graph(tmp_path, decoder):
    graph, weights, metadata = decoder
    bad = Graph(graph.nodes + [Node(99, Add(), ["logits", "nowhere"], ["x"])], graph.inputs,
                graph.outputs, {})
    save_model(tmp_path / "bad.model", bad, weights, metadata).close()
    with pytest.raises(GraphValidationError):
        load_model(tmp_path / "bad.model")


def test_mini_graph_fixture_is_valid(tmp_path):
    graph, weights, metadata = mini_graph()
    with save_model(tmp_path / "mini.model", graph, weights, metadata):
        pass
    with load_model(tmp_path / "mini.model") as m:
        assert isinstance(m.weights["lm_head.weight"], QuantizedArray)
        assert m.warnings == []


# -- docs --------------------------------------------------------------------------------------
def _doc_hex_block(title: str) -> bytes:
    doc = (Path(__file__).parent.parent / "docs" / "format.md").read_text()
    m = re.search(rf"<!-- hex: {re.escape(title)} -->\n```text\n(.*?)```", doc, re.S)
    assert m, f"docs/format.md has no hex block {title!r}"
    return bytes.fromhex("".join(line.split("#")[0] for line in m.group(1).splitlines()))


def test_docs_worked_graph_example_matches_the_codec():
    from dist_runtime.ir.codec import decode_graph
    from dist_runtime.ir.ops import RmsNorm

    g = Graph([Node(7, RmsNorm(eps=1e-5), ["x", "w"], ["y"], backend_hint=0)],
              [TensorSpec((-1, 4), DType.F32)], ["y"], {})
    raw = _doc_hex_block("one-node graph")
    assert raw == encode_graph(g)
    assert decode_graph(raw) == g


def test_docs_worked_container_example_matches_the_writer(tmp_path):
    x = np.array([1.0, 2.0], np.float32)
    save_model(tmp_path / "m.model", None, {"w": x}, {"name": "demo"}).close()
    assert _doc_hex_block("small container") == (tmp_path / "m.model").read_bytes()


def test_read_sections_on_bytes():
    raw = encode_container([("metadata.toml", b"")])
    s, end = read_sections(raw)
    assert (s.name, s.header_offset, s.offset, s.size) == ("metadata.toml", 11, 64, 0)
    assert (end.name, end.header_offset, end.offset, end.size) == ("end", 64, 128, 0)
    assert len(raw) == 128
    with pytest.raises(ModelFormatError):
        read_sections(raw[:-1])


def test_docs_element_type_table_matches_dtypes():
    doc = (Path(__file__).parent.parent / "docs" / "format.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \|", doc, re.M)
    table = {name: (int(tag), int(bs), int(bb)) for name, tag, bs, bb in rows}
    assert table == {d.name.lower(): (d.value, d.block_size, d.block_bytes) for d in DType}


def test_docs_q4_0_and_q8_0_layouts_match_gguf():
    """The nibble order and formulas docs/format.md gives, checked against gguf's dequantize."""
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for qtype in (T.Q4_0, T.Q8_0, T.Q4_1, T.Q5_0, T.Q5_1):
        blocks = gguf.quants.quantize(x, qtype).reshape(-1, DType[qtype.name].block_bytes)
        want = gguf.quants.dequantize(blocks, qtype).reshape(-1, 32)
        for b, blk in enumerate(blocks):
            d = float(blk[:2].view(np.float16)[0])
            m = float(blk[2:4].view(np.float16)[0]) if qtype in (T.Q4_1, T.Q5_1) else 0.0
            if qtype == T.Q8_0:
                q = blk[2:].view(np.int8).astype(np.float64)
                got = q * d
            else:
                qs = blk[-16:]
                nib = np.array([qs[j] & 0x0F if j < 16 else qs[j - 16] >> 4 for j in range(32)])
                if qtype in (T.Q5_0, T.Q5_1):
                    h = int.from_bytes(blk[-20:-16].tobytes(), "little")
                    nib = nib | np.array([((h >> j) & 1) << 4 for j in range(32)])
                offset = {T.Q4_0: 8, T.Q5_0: 16}.get(qtype, 0)
                got = (nib.astype(np.float64) - offset) * d + m
            np.testing.assert_allclose(got, want[b], rtol=1e-6, atol=1e-6)


def test_large_writes_are_chunked_with_optional_progress(tmp_path, monkeypatch, capsys):
    import dist_runtime.model as model_mod

    monkeypatch.setattr(model_mod, "_PROGRESS_THRESHOLD", 0)  # as if the total were > 64 MiB
    monkeypatch.setattr(model_mod, "_WRITE_CHUNK", 7)
    rng = np.random.default_rng(3)
    weights = {"a": rng.standard_normal(33).astype(np.float32), "b": np.arange(5, dtype=np.int16)}
    save_model(tmp_path / "c.model", None, weights).close()
    with load_model(tmp_path / "c.model") as m:
        for name, arr in weights.items():
            np.testing.assert_array_equal(m.weights[name], arr)


def test_toml_graph_listing_weights_must_agree_with_the_index(tmp_path, decoder):
    from dist_runtime.ir.toml_form import graph_to_toml

    graph, weights, metadata = decoder
    raw = save_model(tmp_path / "a.model", graph, weights, metadata)
    raw.close()
    data = (tmp_path / "a.model").read_bytes()
    parts = {s.name: data[s.offset : s.end] for s in read_sections(data)}

    def with_graph_toml(stored: Graph) -> Path:
        text = graph_to_toml(stored, include_weights=True).encode()
        out = tmp_path / "t.model"
        out.write_bytes(encode_container([
            ("metadata.toml", parts["metadata.toml"]), ("tensors.toml", parts["tensors.toml"]),
            ("graph.toml", text), ("weights", parts["weights"])]))
        return out

    with load_model(with_graph_toml(raw.graph)) as m:  # the same weights as the index: fine
        assert m.graph == raw.graph and m.graph_format == "toml"
    renamed = dict(raw.graph.weights)
    renamed["model.norm.weight2"] = renamed.pop("model.norm.weight")
    bad = Graph(raw.graph.nodes, raw.graph.inputs, raw.graph.outputs, renamed)
    with pytest.raises(ModelFormatError, match="do not match the tensors index"):
        load_model(with_graph_toml(bad), validate=False)
    reshaped = dict(raw.graph.weights)
    reshaped["model.norm.weight"] = TensorSpec((4, 4), DType.F32)
    bad = Graph(raw.graph.nodes, raw.graph.inputs, raw.graph.outputs, reshaped)
    with pytest.raises(ModelFormatError, match=r"'model.norm.weight' is f32\[4,4\] in the graph"):
        load_model(with_graph_toml(bad), validate=False)


def test_a_deferred_weight_is_made_when_written_and_let_go(tmp_path, decoder):
    """save_model makes a Deferred weight at its turn (after the one before it is written) and
    calls its done() once it is written: the same file as the weights given made."""
    from dist_runtime.tensor import Deferred

    graph, weights, meta = decoder
    eager = save_model(tmp_path / "eager.model", graph, weights, meta, progress=False)
    eager.close()
    events = []

    def deferred(name, w):
        def make():
            events.append(("make", name))
            return w
        return Deferred(dtype_of(w), tuple(w.shape), make, lambda: events.append(("done", name)))
    lazy = save_model(tmp_path / "lazy.model", graph, {n: deferred(n, w) for n, w in weights.items()}, meta,
                      progress=False)
    lazy.close()
    assert (tmp_path / "lazy.model").read_bytes() == (tmp_path / "eager.model").read_bytes()
    assert events == [e for n in weights for e in (("make", n), ("done", n))]


def test_a_deferred_weight_made_other_than_promised_is_refused(tmp_path, decoder):
    from dist_runtime.tensor import Deferred

    graph, weights, meta = decoder
    name = next(iter(weights))
    w = weights[name]
    wrong = dict(weights)
    wrong[name] = Deferred(dtype_of(w), tuple(w.shape), lambda: w[:1])
    with pytest.raises(ValueError, match=f"weight {name!r}: made as F32.*promised F32"):
        save_model(tmp_path / "bad.model", graph, wrong, meta, progress=False)
    assert not list(tmp_path.iterdir())  # atomic: nothing left behind
